"""Fixtures shared by the tests of the Caffe front end."""

import logging

import pytest


@pytest.fixture
def log_lines():
    """The messages of the project's logger during the test."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep()
    log = logging.getLogger("purine")
    log.addHandler(handler)
    yield lines
    log.removeHandler(handler)
