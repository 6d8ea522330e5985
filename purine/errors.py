"""The project's exceptions: every error a user can cause is a PurineError whose message
names the file, the layer or the line, and what was expected; commands turn them into one
line and an exit code."""

import sys
import warnings
from collections.abc import Callable

FLOAT_WARNINGS = r"(overflow|invalid value|divide by zero|underflow) encountered"


_CONTROL = {c: f"\\x{c:02x}" for c in range(32)} | {10: "\\n", 13: "\\r", 9: "\\t"}


def one_line(text: str) -> str:
    """``text`` with its control characters written as escapes (a layer name or a path may
    hold a newline or a NUL; an error message stays one line)."""
    return text.translate(_CONTROL)


class PurineError(Exception):
    """Base of every error the project raises on purpose. Its message is one line: control
    characters that a name or a path brings in are written as escapes."""

    def __init__(self, message: object = "", *args: object):
        super().__init__(one_line(str(message)), *args)


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


USER_CODE = "purine_raised_in"
"""The attribute ``from_user_code`` sets on an exception a user's own code raised."""


def from_user_code(e: BaseException, where: str) -> BaseException:
    """A user's code (a Python layer's method) raised ``e``: it keeps its own type, as
    Caffe's caller sees it, with a note saying where (``where``) it came from; commands print
    it as one line. Returns ``e`` to re-raise."""
    if getattr(e, USER_CODE, None) is None:
        try:
            setattr(e, USER_CODE, where)
        except AttributeError:  # an exception type that takes no attributes
            return e
        if hasattr(e, "add_note"):  # Python 3.11+: shown under the traceback
            e.add_note(f"raised in {where}")
    return e


def run_reporting(prog: str, run: Callable[[], int]) -> int:
    """Run a command: a user's error (a PurineError, or an OSError such as an unwritable
    output) becomes one line on stderr and exit code 1; Ctrl-C exit code 130. Floating-point
    overflow and invalid values stay silent, as in Caffe's C arithmetic: a diverging run is
    reported by the solver's own loss check, not by numpy's warnings before that line."""
    try:
        with warnings.catch_warnings():  # process-wide: the dispatcher's threads too
            warnings.filterwarnings("ignore", FLOAT_WARNINGS, RuntimeWarning)
            return run()
    except (PurineError, OSError) as e:
        print(f"{prog}: {one_line(str(e))}", file=sys.stderr)
        return 1
    except Exception as e:
        where = getattr(e, USER_CODE, None)
        if where is None:
            raise
        print(f"{prog}: {where} raised {type(e).__name__}: {one_line(str(e))}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
