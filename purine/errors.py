"""The project's exceptions: every error a user can cause is a PurineError whose message
names the file, the layer or the line, and what was expected; commands turn them into one
line and an exit code."""

import sys
from collections.abc import Callable


class PurineError(Exception):
    """Base of every error the project raises on purpose."""


class ProtoError(PurineError):
    """A prototxt / caffemodel that cannot be read: names the file and, for text, line:column."""


class GraphError(PurineError):
    """A graph that breaks a contract: two writers, a shape mismatch, an unknown blob."""


class LayerError(PurineError):
    """A layer that cannot be built: names the layer, its type and the shapes involved."""

    def __init__(self, layer_name: str, layer_type: str, message: str):
        super().__init__(f"layer '{layer_name}' (type {layer_type}): {message}")
        self.layer_name = layer_name
        self.layer_type = layer_type


class LabelError(PurineError):
    """A class label outside ``[0, classes)`` that is not the ignore_label (found at run
    time by a loss kernel)."""


def run_reporting(prog: str, run: Callable[[], int]) -> int:
    """Run a command: a user's error (a PurineError, or an OSError such as an unwritable
    output) becomes one line on stderr and exit code 1; Ctrl-C exit code 130."""
    try:
        return run()
    except (PurineError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
