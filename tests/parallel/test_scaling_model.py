"""The scaling simulation of bench/simulate_scaling.py: the ring all-reduce cost, iteration
times with and without overlap computed by hand for a three-gradient toy, and the profile
it takes from a real solver's graph."""

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


def test_two_devices_without_and_with_overlap():
    p = sim.predict(TOY, 2, bandwidth=1.0, latency=0.5)
    assert TOY.one_device_s == 12.0
    assert p.serial_s == 10 + (3 + 5 + 2) + (0.5 + 0.5 + 1)  # 22
    # a: ready at 4, on the link 4-7, updated 10-10.5 (after the backward pass);
    # b: ready at 6, waits for the link, 7-12, updated 12-12.5;
    # c: ready at 9, waits for the link, 12-14, updated 14-15.
    assert p.overlap_s == 15.0
    assert p.devices == 2


def test_four_devices_without_and_with_overlap():
    p = sim.predict(TOY, 4, bandwidth=1.0, latency=0.5)
    assert p.serial_s == 10 + (6 + 9 + 4.5) + 2  # 31.5
    # a: 4-10, updated 10-10.5; b: 10-19, updated 19-19.5; c: 19-23.5, updated 23.5-24.5.
    assert p.overlap_s == 24.5


def test_a_free_link_costs_nothing_and_overlap_hides_what_the_backward_covers():
    free = sim.predict(TOY, 64, bandwidth=float("inf"), latency=0.0)
    assert free.serial_s == free.overlap_s == TOY.one_device_s
    # 1 s per exchange (N = 2, 1 byte/s, no latency): a 4-5, b 6-7, c 9-10, all inside
    # the backward pass, so with overlap only the updates follow it.
    one_byte = sim.Profile(10.0, tuple(sim.Gradient(g.name, 1, g.ready_s, g.update_s)
                                       for g in TOY.gradients))
    p = sim.predict(one_byte, 2, bandwidth=1.0, latency=0.0)
    assert (p.serial_s, p.overlap_s) == (15.0, 12.0)


def test_table_rows():
    rows = sim.table(TOY, [sim.predict(TOY, 2, 1.0, 0.5)])  # in ms
    assert rows[1].split() == ["1", "12000.0", "12000.0", "1.00", "/", "1.00", "1.00", "/", "1.00"]
    # speed-up 2 * 12 / 22 and 2 * 12 / 15; efficiency 12 / 22 and 12 / 15
    assert rows[2].split() == ["2", "22000.0", "15000.0", "1.09", "/", "1.60", "0.55", "/",
                               "0.80"]


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
