"""The project's exceptions: every error a user can cause is a PurineError whose message
names the file, the layer or the line, and what was expected."""


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
