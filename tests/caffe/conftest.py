"""Fixtures shared by the tests of the Caffe front end."""

import logging

import pytest

from purine.log import get_logger


@pytest.fixture
def log_lines():
    """The messages of the project's logger during the test."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep()
    log = get_logger()  # INFO, whichever test ran before (or none)
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    yield lines
    log.removeHandler(handler)
    log.setLevel(level)
