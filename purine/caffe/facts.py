"""What a layer type declares about itself where it is registered: how it splits into towers,
its export form, how Caffe's drawing labels and colours it, the fork it comes from. Plain data
and small functions over its LayerParameter, read by placement, the exporters and drawing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb

# A per-channel layer's split rule: tower k computes channels k of T of its bottom's part.
CHANNELS = "channels"
# The end of a training layer's ``train_only``: what to export instead.
DEPLOY = "; export a deploy prototxt without it"


class SplitRefused(PurineError):
    """A split rule's refusal of one layer (placement names the layer and the tower count)."""


@dataclass(frozen=True)
class TowerSplit:
    """How one layer splits into T towers: whether tower k takes channel part k of the bottom
    (else all of it), the axis each parameter blob splits along, and the edit that makes a
    tower's LayerParameter from a copy of the layer's (num_output / T ...)."""

    by_input: bool
    axes: tuple[int, ...] = ()
    tower: Callable[[pb.LayerParameter], None] | None = None


# (LayerParameter, T) -> how it splits into T towers; raises SplitRefused.
SplitRule = Callable[[pb.LayerParameter, int], TowerSplit]


@dataclass(frozen=True)
class LayerFacts:
    """The facts of one layer type; each default means "none": no fork, no tower split, no
    export form, Caffe's default colour and no extra label lines."""

    fork: str = ""  # the Caffe fork the type comes from, named in an exporter's refusal
    train_only: str = ""  # why no exporter writes it (a training layer), and what to do
    split: SplitRule | str | None = None  # a rule, or CHANNELS for a per-channel layer
    replicates: bool = True  # False: a data-parallel replica cannot run it on its batch part
    # The export form both exporters know it by ("convolution", "relu", ...); an exporter
    # implementing no such form refuses the layer.
    export: str = ""
    colour: str = ""  # the fill colour of Caffe's draw_net
    label: Callable[[pb.LayerParameter], list[str]] | None = None  # layer view's extra lines
    # pycaffe draw's (kernel, stride, pad) strings for a window layer
    window: Callable[[pb.LayerParameter], tuple[str, str, str]] | None = None
    # a learning layer's num_output (pycaffe draw's edge label and lr_mult)
    num_output: Callable[[pb.LayerParameter], int] | None = None


NO_FACTS = LayerFacts()
FACTS: dict[str, LayerFacts] = {}


def declare(*types: str, **facts: object) -> None:
    """Record ``facts`` (LayerFacts' fields) for each of ``types``; once per type."""
    record = LayerFacts(**facts)  # type: ignore[arg-type]
    for t in types:
        if t in FACTS:
            raise ValueError(f"layer type {t}: facts declared twice")
        FACTS[t] = record


def facts(layer_type: str) -> LayerFacts:
    """The facts declared for ``layer_type`` (every field at its default when none were)."""
    return FACTS.get(layer_type, NO_FACTS)


def types_with(test: Callable[[LayerFacts], bool]) -> list[str]:
    """The registered types whose facts pass ``test``, sorted."""
    return sorted(t for t, f in FACTS.items() if test(f))
