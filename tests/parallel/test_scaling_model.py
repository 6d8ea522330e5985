"""The scaling simulation of bench/simulate_scaling.py: the ring all-reduce and exchange
costs, iteration times with and without overlap computed by hand for small toys (one thread
exchanging and updating beside the compute thread, sharing the cores), the table, and the
profile it takes from a real solver's graph."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "simulate_scaling", os.path.join(ROOT, "bench", "simulate_scaling.py"))
sim = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("simulate_scaling", sim)  # its dataclasses look their module up
_spec.loader.exec_module(sim)

# Bandwidth 1 byte/s and latency 0.5 s: with N = 2 a gradient of b bytes costs b + 1 s,
# with N = 4 1.5 b + 3 s. In exchange order:
TOY = sim.Profile(compute_s=10.0, gradients=(
    sim.Gradient("a", nbytes=2, ready_s=4.0, update_s=0.5),   # N=2: 3 s;   N=4: 6 s
    sim.Gradient("b", nbytes=4, ready_s=6.0, update_s=0.5),   # N=2: 5 s;   N=4: 9 s
    sim.Gradient("c", nbytes=1, ready_s=9.0, update_s=1.0),   # N=2: 2 s;   N=4: 4.5 s
))


def test_ring_all_reduce_cost():
    assert sim.ring_all_reduce_s(4, 2, 1.0, 0.5) == 5.0
    assert sim.ring_all_reduce_s(4, 4, 1.0, 0.5) == 9.0
    assert sim.ring_all_reduce_s(10**9, 1, 1.0, 0.5) == 0.0  # one device exchanges nothing
    # 100 MB over 8 devices at 10 GB/s, 5 us per step: 1.75 * 10 ms + 14 * 5 us.
    assert sim.ring_all_reduce_s(10**8, 8, 1e10, 5e-6) == pytest.approx(0.01757)


LINK = sim.Machine(bandwidth=1.0, latency=0.5)  # nothing else charged, cores to spare


def test_an_exchange_charges_the_ring_a_message_and_the_arithmetic():
    m = sim.Machine(bandwidth=1.0, latency=0.5, message_s=0.25, memory_bandwidth=2.0)
    # ring 5 s, one message 0.25 s, sums of 4 * 1/2 bytes and the scale of 4, at 2 bytes/s
    assert sim.exchange_s(4, 2, m) == 5 + 0.25 + (2 + 4) / 2
    assert sim.exchange_s(4, 1, m) == 0.0  # one device exchanges nothing


def test_two_devices_without_and_with_overlap():
    p = sim.predict(TOY, 2, LINK)
    assert TOY.one_device_s == 12.0
    assert p.serial_s == 10 + (3 + 5 + 2) + (0.5 + 0.5 + 1)  # 22
    # One thread exchanges and updates, first come first served: a ready at 4, exchanged
    # 4-7; then its update (7-7.5) and b's exchange (ready at 6) wait in that order: b
    # 7.5-12.5, its update 12.5-13, c 13-15, its update 15-16.
    assert p.overlap_s == 16.0
    assert p.devices == 2


def test_four_devices_without_and_with_overlap():
    p = sim.predict(TOY, 4, LINK)
    assert p.serial_s == 10 + (6 + 9 + 4.5) + 2  # 31.5
    # a 4-10, update 10-10.5; b 10.5-19.5, update -20; c 20-24.5, update 24.5-25.5
    assert p.overlap_s == 25.5


def test_a_free_link_and_updates_beside_the_backward_pass():
    free = sim.predict(TOY, 64, sim.Machine(float("inf"), 0.0))
    # serially the updates follow the backward pass as on one device; overlapped, with
    # cores to spare, each runs beside it (a 4-4.5, b 6-6.5, c 9-10)
    assert (free.serial_s, free.overlap_s) == (12.0, 10.0)
    # 1 s per exchange (N = 2, 1 byte/s, no latency): a 4-5, its update 5-5.5, b 6-7,
    # 7-7.5, c 9-10, its update 10-11 after the backward pass.
    one_byte = sim.Profile(10.0, tuple(sim.Gradient(g.name, 1, g.ready_s, g.update_s)
                                       for g in TOY.gradients))
    p = sim.predict(one_byte, 2, sim.Machine(1.0, 0.0))
    assert (p.serial_s, p.overlap_s) == (15.0, 11.0)


# 4 s of compute, one gradient of 2 bytes ready at 2 s whose exchange costs 2 s at N = 2
# (1 byte/s, no latency) and whose update costs 1 s.
ONE = sim.Profile(4.0, (sim.Gradient("w", nbytes=2, ready_s=2.0, update_s=1.0),))


def test_compute_and_exchange_share_the_cores():
    # One core: 0-2 compute alone; 2-6 compute (2 s left) and exchange (2 s) at half speed
    # each; 6-7 the update alone. Overlap buys nothing on one core.
    one_core = sim.Machine(1.0, 0.0, cores=1.0)
    assert sim.predict(ONE, 2, one_core) == sim.Prediction(2, 7.0, 7.0)
    # Two cores: 2-4 compute and exchange at full speed each, the update 4-5.
    assert sim.predict(ONE, 2, sim.Machine(1.0, 0.0, cores=2.0)).overlap_s == 5.0
    # Compute 1.5 times slower beside the other ranks: 6 s, its gradient ready at 3; 3-7
    # both at half speed (the exchange ends, 1 s of compute left), 7-9 compute and update
    # at half speed.
    slow = sim.Machine(1.0, 0.0, cores=1.0, contention=1.5)
    assert sim.predict(ONE, 2, slow) == sim.Prediction(2, 6 + 2 + 1, 9.0)


def test_table_rows():
    rows = sim.table(TOY, [sim.predict(TOY, 2, LINK), sim.predict(TOY, 4, LINK)],
                     measured={2: 0.70})  # in ms
    assert rows[1].split() == ["1", "12000.0", "12000.0", "1.00", "/", "1.00", "1.00", "/", "1.00"]
    # speed-up 2 * 12 / 22 and 2 * 12 / 16; efficiency 12 / 22 and 12 / 16; measured 0.70:
    # the prediction with overlap is 5 points above it
    assert rows[2].split() == ["2", "22000.0", "16000.0", "1.09", "/", "1.50", "0.55", "/",
                               "0.75", "0.70", "+5.0"]
    assert rows[3].split()[-1] == "0.47"  # 12 / 25.5, nothing measured at 4


def test_profile_from_a_lenet_solver_graph():
    from purine.caffe.solver import Solver

    with Solver(sim.solver_param("lenet", batch=2)) as s:
        ops = s.net._forward_ops + s.net._backward_ops + s.update_ops
        profile = sim.profile_ops(s, {op: 1.0 for op in ops})  # every op 1 s
    names = [g.name for g in profile.gradients]
    assert names == ["ip2[1]", "ip2[0]", "ip1[1]", "ip1[0]", "conv2[1]", "conv2[0]",
                     "conv1[1]", "conv1[0]"]  # purine's exchange order
    by_name = {g.name: g for g in profile.gradients}
    assert by_name["ip2[0]"].nbytes == 10 * 500 * 4
    assert by_name["conv1[1]"].nbytes == 20 * 4
    # 11 forward ops (2 DummyData fills, 9 of the layers), then the backward's loss weight,
    # loss gradient and ip2's weight gradient: ready after 14 ops; conv1's bias gradient is
    # written by the last of the 16 backward ops.
    assert by_name["ip2[0]"].ready_s == 14.0
    assert by_name["ip2[1]"].ready_s == 15.0
    assert by_name["conv1[1]"].ready_s == 27.0
    assert {g.update_s for g in profile.gradients} == {2.0}  # prepare and update
    assert profile.compute_s == len(ops) - 16  # the 8 parameters' 16 update ops apart
