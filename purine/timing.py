"""``caffe time``: one initial forward+backward pass, then ``iterations`` timed passes with
each layer's forward and backward time taken from the dispatcher's profile trace; the
figures and log lines are those of Caffe's ``time`` command."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from purine.backend import synchronize
from purine.backend.onednn import pass_scope
from purine.caffe.net import Net


@dataclass
class Timing:
    initial_loss: float
    iterations: list[float]  # ms of each timed forward+backward pass
    forward_ms: float  # average forward pass
    backward_ms: float  # average backward pass
    layers: list[tuple[str, float, float]]  # (layer, forward ms, backward ms) per iteration
    total_ms: float  # the timed passes end to end, as Caffe's total timer

    @property
    def forward_backward_ms(self) -> float:
        """Caffe's "Average Forward-Backward": the total over the number of iterations."""
        return self.total_ms / max(len(self.iterations), 1)


def time_net(net: Net, iterations: int, log: logging.Logger | None = None) -> Timing:
    """Run Caffe's benchmark on ``net`` and, given ``log``, print its lines."""
    with pass_scope():  # the kernels' thread settings once for the run, not per pass
        return _time_net(net, iterations, log)


def _time_net(net: Net, iterations: int, log: logging.Logger | None) -> Timing:
    info = log.info if log else (lambda *a: None)
    # The initial pass allocates the arrays and warms caches; it is outside every figure.
    info("Performing Forward")
    net.forward()
    initial_loss = net.loss
    info("Initial loss: %g", initial_loss)
    info("Performing Backward")
    net.backward()
    synchronize(net.location)  # GPU: the initial pass is done before the clock starts
    info("*** Benchmark begins ***")
    info("Testing for %d iterations.", iterations)
    net.profile(True)  # every build's dispatcher: a pass may change build (shapes)
    fwd = bwd = 0.0
    per_iter = []
    try:
        start = time.perf_counter()
        for i in range(iterations):
            t0 = time.perf_counter()
            net.forward()
            synchronize(net.location)
            t1 = time.perf_counter()
            net.backward()
            synchronize(net.location)
            t2 = time.perf_counter()
            fwd += t1 - t0
            bwd += t2 - t1
            per_iter.append((t2 - t0) * 1e3)
            info("Iteration: %d forward-backward time: %g ms.", i + 1, per_iter[-1])
        total = (time.perf_counter() - start) * 1e3
    finally:
        events = net.profile(False)
    op_layer = {}
    for b in net.builds():
        for L in b.layers:
            for op in L.forward_ops:
                op_layer[op] = (L.name, 0)
            for op in L.backward_ops:
                op_layer[op] = (L.name, 1)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in events:
        if e.op in op_layer:
            name, which = op_layer[e.op]
            totals[name][which] += e.end - e.start
    n = max(iterations, 1)
    layers = [(L.name, totals[L.name][0] * 1e3 / n, totals[L.name][1] * 1e3 / n)
              for L in net.whole.layers]
    t = Timing(initial_loss, per_iter, fwd * 1e3 / n, bwd * 1e3 / n, layers, total)
    info("Average time per layer: ")
    for name, f, b in t.layers:
        info("%10s\tforward: %g ms.", name, f)
        info("%10s\tbackward: %g ms.", name, b)
    info("Average Forward pass: %g ms.", t.forward_ms)
    info("Average Backward pass: %g ms.", t.backward_ms)
    info("Average Forward-Backward: %g ms.", t.forward_backward_ms)
    info("Total Time: %g ms.", t.total_ms)
    info("*** Benchmark ends ***")
    return t
