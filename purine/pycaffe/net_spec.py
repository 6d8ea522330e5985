"""pycaffe's net specification: ``caffe.layers`` (L), ``caffe.params`` (P), ``caffe.NetSpec``
and ``caffe.to_proto`` write a ``NetParameter`` from Python, with pycaffe's keyword routing,
list/dict assignment rules and automatic names, so ``str(n.to_proto())`` is a prototxt."""

from __future__ import annotations

from collections import Counter
from typing import Any

from google.protobuf.message import Message

from purine.formats import caffe_pb2 as pb

__all__ = ["Function", "NetSpec", "Top", "assign_proto", "layers", "param_name_dict",
           "params", "to_proto"]


def param_name_dict() -> dict[str, str]:
    """Layer type -> the prefix of its ``<prefix>_param`` field in LayerParameter.

    Read off the descriptor: a field ``foo_param`` whose message is ``BarParameter`` serves
    type ``Bar``. So ``Convolution`` -> ``convolution``, ``TanH`` -> ``tanh``, and, as in
    pycaffe, types without a message of their own name (``Deconvolution``, ``RNN``,
    ``LSTM``) get none: their settings go in an explicit ``convolution_param=dict(...)`` /
    ``recurrent_param=dict(...)``."""
    names = {}
    for field in pb.LayerParameter.DESCRIPTOR.fields:
        if field.name.endswith("_param") and field.message_type is not None:
            names[field.message_type.name[:-len("Parameter")]] = field.name[:-len("_param")]
    return names


_PARAM_NAMES = param_name_dict()


class _FieldError(AttributeError):
    """A keyword or dict key that names no field; carries the message path for the report."""


def assign_proto(proto: Message, name: str, val: Any) -> None:
    """Set field ``name`` of ``proto`` from a Python value, recursively: a dict fills a
    message, a list fills a repeated field (a list of dicts adds one message per dict), a
    scalar given to a repeated field is a one-item list, anything else is set directly.
    An unknown field raises AttributeError, a value of the wrong kind protobuf's TypeError
    or ValueError."""
    if name not in proto.DESCRIPTOR.fields_by_name:
        raise _FieldError(f"{proto.DESCRIPTOR.name} has no field '{name}'")
    field = getattr(proto, name)
    if isinstance(val, tuple):  # pycaffe takes lists only; a tuple means the same here
        val = list(val)
    if hasattr(field, "extend") and not isinstance(val, list):
        val = [val]
    if isinstance(val, list):
        if val and isinstance(val[0], dict):
            for item in val:
                message = field.add()
                for key, value in item.items():
                    assign_proto(message, key, value)
        else:
            field.extend(val)
    elif isinstance(val, dict):
        for key, value in val.items():
            assign_proto(field, key, value)
    elif isinstance(val, Message) and isinstance(field, Message):
        field.CopyFrom(val)
    else:
        setattr(proto, name, val)


class Top:
    """One output blob of a layer: the ``n``-th top of Function ``fn``."""

    def __init__(self, fn: Function, n: int):
        self.fn = fn
        self.n = n

    def to_proto(self) -> pb.NetParameter:
        """The layers needed to compute this top, names generated."""
        return to_proto(self)

    def _update(self, params: dict[str, Any]) -> None:
        self.fn._update(params)

    def _to_proto(self, layers: dict, names: dict, autonames: Counter) -> None:
        self.fn._to_proto(layers, names, autonames)


class Function:
    """A layer: its type, its bottoms (Tops of other layers) and its keyword settings.
    ``ntop`` (default 1) and ``in_place`` are taken out of the keywords here."""

    def __init__(self, type_name: str, inputs: tuple, params: dict[str, Any]):
        for i, bottom in enumerate(inputs):
            if not isinstance(bottom, Top):
                raise TypeError(f"{type_name} input {i} is not a Top "
                                f"(type is {type(bottom)})")
        self.type_name = type_name
        self.inputs = inputs
        self.params = params
        self.ntop = params.pop("ntop", 1)
        self.in_place = params.pop("in_place", False)
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _update(self, params: dict[str, Any]) -> None:
        self.params.update(params)

    def _top_name(self, top: Top, names: dict, autonames: Counter) -> str:
        # An unnamed top is <Type><k>, k counting that type's automatic names so far.
        if top not in names:
            autonames[top.fn.type_name] += 1
            names[top] = f"{top.fn.type_name}{autonames[top.fn.type_name]}"
        return names[top]

    def _name(self, names: dict, autonames: Counter) -> str:
        # A layer takes its first top's name; a layer without tops counts on its own.
        if self not in names:
            if self.ntop > 0:
                names[self] = self._top_name(self.tops[0], names, autonames)
            else:
                autonames[self.type_name] += 1
                names[self] = f"{self.type_name}{autonames[self.type_name]}"
        return names[self]

    def _to_proto(self, layers: dict, names: dict, autonames: Counter) -> None:
        if self in layers:
            return
        # Depth first: every bottom's layer is emitted before this one.
        bottoms = []
        for bottom in self.inputs:
            bottom._to_proto(layers, names, autonames)
            bottoms.append(layers[bottom.fn].top[bottom.n])
        layer = pb.LayerParameter(type=self.type_name, bottom=bottoms)
        if self.in_place:
            layer.top.extend(bottoms)
        else:
            layer.top.extend(self._top_name(t, names, autonames) for t in self.tops)
        layer.name = self._name(names, autonames)
        for key, value in self.params.items():
            self._assign(layer, key, value)
        layers[self] = layer

    def _assign(self, layer: pb.LayerParameter, key: str, value: Any) -> None:
        """Route one keyword: ``*param`` keywords are LayerParameter fields; others go to
        the type's own ``<type>_param`` message when it has that field, else to the layer
        (``name``, ``loss_weight``, ``include`` ...)."""
        where = f"{self.type_name} layer '{layer.name}'"
        target: Message = layer
        looked = "LayerParameter"
        prefix = _PARAM_NAMES.get(self.type_name)
        if not key.endswith("param") and prefix is not None:
            typed = getattr(layer, prefix + "_param")
            looked = f"{typed.DESCRIPTOR.name} or LayerParameter"
            if key in typed.DESCRIPTOR.fields_by_name:
                target = typed
        if key not in target.DESCRIPTOR.fields_by_name:
            raise AttributeError(f"{where}: unknown keyword '{key}' (no field '{key}' in "
                                 f"{looked})")
        try:
            assign_proto(target, key, value)
        except _FieldError as e:
            raise AttributeError(f"{where}: keyword '{key}': {e}") from None
        except AttributeError as e:  # protobuf refusing a scalar for a message field
            raise AttributeError(f"{where}: keyword '{key}' needs a dict for "
                                 f"{target.DESCRIPTOR.name}.{key} ({e})") from None
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: keyword '{key}'={value!r}: {e}") from None


class _MissingTop(AttributeError, KeyError):
    """A name a NetSpec does not hold: KeyError as pycaffe raises it, AttributeError so
    that ``hasattr`` and ``getattr(n, name, default)`` work."""

    def __str__(self) -> str:
        return str(self.args[0])


class NetSpec:
    """Named tops: assign ``n.conv1 = L.Convolution(...)`` (or ``n["conv1"] = ...``) and
    ``n.to_proto()`` names each assigned top, and the layer producing it, by that name."""

    def __init__(self) -> None:
        object.__setattr__(self, "tops", {})

    def __setattr__(self, name: str, value: Any) -> None:
        self.tops[name] = value

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["tops"][name]
        except KeyError:
            raise _MissingTop(f"NetSpec has no top '{name}'") from None

    def __setitem__(self, name: str, value: Any) -> None:
        self.tops[name] = value

    def __getitem__(self, name: str) -> Any:
        return self.__getattr__(name)

    def __delitem__(self, name: str) -> None:
        del self.tops[name]

    def keys(self) -> list[str]:
        return list(self.tops)

    def vals(self) -> list[Any]:
        return list(self.tops.values())

    def update(self, name: str, params: dict[str, Any]) -> None:
        """Add or change keyword settings of the layer behind top ``name``."""
        self.tops[name]._update(params)

    def to_proto(self) -> pb.NetParameter:
        """Every layer the assigned tops need, in the order a depth-first walk from the
        tops (in assignment order) first meets them."""
        names = {top: name for name, top in self.tops.items()}
        layers: dict[Function, pb.LayerParameter] = {}
        autonames: Counter = Counter()
        for top in self.tops.values():
            top._to_proto(layers, names, autonames)
        return pb.NetParameter(layer=list(layers.values()))


def to_proto(*tops: Top | Function) -> pb.NetParameter:
    """The layers needed to compute ``tops``, every blob and layer named automatically."""
    layers: dict[Function, pb.LayerParameter] = {}
    autonames: Counter = Counter()
    for top in tops:
        top._to_proto(layers, {}, autonames)
    return pb.NetParameter(layer=list(layers.values()))


class Layers:
    """``L.<Type>(*bottoms, **settings)``: a Top (one top), a tuple of Tops (``ntop`` > 1)
    or the Function itself (``ntop=0``)."""

    def __getattr__(self, type_name: str) -> Any:
        if type_name.startswith("__"):
            raise AttributeError(type_name)

        def layer(*bottoms: Top, **settings: Any) -> Top | tuple[Top, ...] | Function:
            fn = Function(type_name, bottoms, settings)
            if fn.ntop == 0:
                return fn
            return fn.tops[0] if fn.ntop == 1 else fn.tops
        layer.__name__ = type_name
        return layer


class _EnumValues:
    def __init__(self, message: str):
        self._message = message

    def __getattr__(self, value_name: str) -> Any:
        return getattr(getattr(pb, self._message), value_name)


class Parameters:
    """``P.<Type>.<NAME>``: the value of enum ``NAME`` in message ``<Type>Parameter``,
    e.g. ``P.Pooling.MAX`` == 0, ``P.Data.LMDB`` == 1."""

    def __getattr__(self, type_name: str) -> _EnumValues:
        if type_name.startswith("__"):
            raise AttributeError(type_name)
        return _EnumValues(type_name + "Parameter")


layers = Layers()
params = Parameters()
