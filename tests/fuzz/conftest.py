"""Hypothesis profiles for the fuzz suite and its guards.

``ci`` (the default) is bounded and derandomized: the folder runs about 9,400 cases in about
two minutes, the same ones every run. ``long`` runs 15 times as many (about 140,000), from a
random start each time: ``PURINE_FUZZ=long pytest tests/fuzz`` or
``pytest tests/fuzz --hypothesis-profile long`` (the option needs tests/fuzz on the command
line, so that this file is loaded before hypothesis reads it).
"""

from __future__ import annotations

import logging
import os
import resource
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from purine.log import get_logger
from tests.fuzz.harness import EXAMPLES, SKIPPED

CI_EXAMPLES = 1500
"""Each test runs a share of this (harness.share): about 9,400 examples in all."""
LONG_FACTOR = 15

settings.register_profile(
    "ci", max_examples=CI_EXAMPLES, deadline=None, derandomize=True, database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much, HealthCheck.large_base_example])
settings.register_profile("long", settings.get_profile("ci"),
                          max_examples=CI_EXAMPLES * LONG_FACTOR, derandomize=False)
if os.environ.get("PURINE_FUZZ"):
    settings.load_profile(os.environ["PURINE_FUZZ"])
elif settings.get_current_profile_name() == "default":
    settings.load_profile("ci")

HEADROOM = 6 << 30
"""Address space a fuzz case may add to the process: past it an allocation raises
MemoryError (a failure to report) instead of the machine swapping or killing the run."""


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


@pytest.fixture(autouse=True, scope="module")
def bounded_memory(request: pytest.FixtureRequest) -> Iterator[None]:
    """Cap the address space while the module's cases run (the size bound's backstop); a
    module may set its own ``HEADROOM``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + getattr(request.module, "HEADROOM", HEADROOM)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture(autouse=True, scope="module")
def quiet_log() -> Iterator[None]:
    """Thousands of cases would print thousands of snapshot and 'Ignoring' lines."""
    log = get_logger()  # configured first: it sets INFO when it adds its handler
    level = log.level
    log.setLevel(logging.WARNING)
    yield
    log.setLevel(level)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not EXAMPLES:
        return
    tr = terminalreporter
    tr.section(f"fuzz examples (hypothesis profile {settings.get_current_profile_name()!r})")
    for key, n in sorted(EXAMPLES.items()):
        tr.write_line(f"{n:8d}  {key}")
    tr.write_line(f"{sum(EXAMPLES.values()):8d}  in all")
    if SKIPPED:
        skipped = ", ".join(f"{k} {n}" for k, n in sorted(SKIPPED.items()))
        tr.write_line(f"skipped past the size bound (by setting): {skipped}")
