"""``caffe time``: average forward, backward and per-layer times of a net."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from purine.backend import synchronize
from purine.caffe.net import Net


@dataclass
class Timing:
    forward_ms: float
    backward_ms: float
    layers: list[tuple[str, float, float]]  # (layer, forward ms, backward ms) per iteration
    iterations: list[float]


def time_net(net: Net, iterations: int, log=None) -> Timing:
    """Time ``iterations`` forward+backward passes after one untimed warm-up pass."""
    d = net.dispatcher
    net.forward()
    net.backward()
    synchronize(net.location)  # GPU: the warm-up is done before the clock starts
    d.profile, d.trace = True, []
    fwd = bwd = 0.0
    per_iter = []
    for i in range(iterations):
        t0 = time.perf_counter()
        net.forward()
        t1 = time.perf_counter()
        net.backward()
        synchronize(net.location)
        t2 = time.perf_counter()
        fwd += t1 - t0
        bwd += t2 - t1
        per_iter.append((t2 - t0) * 1e3)
        if log:
            log.info("Iteration: %d forward-backward time: %.3f ms.", i + 1, per_iter[-1])
    d.profile = False
    op_layer = {}
    for L in net.builder.layers:
        for op in L.forward_ops:
            op_layer[op] = (L.name, 0)
        for op in L.backward_ops:
            op_layer[op] = (L.name, 1)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in d.trace:
        if e.op in op_layer:
            name, which = op_layer[e.op]
            totals[name][which] += e.end - e.start
    d.trace = []
    n = max(iterations, 1)
    layers = [(L.name, totals[L.name][0] * 1e3 / n, totals[L.name][1] * 1e3 / n)
              for L in net.builder.layers]
    return Timing(fwd * 1e3 / n, bwd * 1e3 / n, layers, per_iter)
