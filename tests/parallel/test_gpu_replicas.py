"""How replicas on GPUs are composed (checked on any machine: the graph is built with
host arrays standing in for device memory; running it needs GPUs, see tests/gpu)."""

from __future__ import annotations

import pytest

import purine.runtime.memory as memory_module
from purine.caffe.solver import Solver
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import parse_text
from purine.graph import Location
from purine.parallel import build_solver
from tests.test_cli import NET

GPU0, GPU1 = Location("gpu", 0), Location("gpu", 1)


@pytest.fixture
def host_memory(monkeypatch):
    import numpy as np

    monkeypatch.setattr(memory_module, "allocate",
                        lambda loc, shape, dtype: np.zeros(shape, dtype))


def solver(**kw) -> Solver:
    param = parse_text(f'net_param {{ {NET} }} base_lr: 0.1 momentum: 0.9 lr_policy: "fixed" '
                       "max_iter: 2 random_seed: 1", pb.SolverParameter())
    return build_solver(param, **kw)


def test_replicas_on_two_gpus_reduce_through_nccl_in_backward_order(host_memory):
    s = solver(location=GPU0, replicas=2, replica_locations=[GPU1])
    g = s.net.graph
    reduce = s.scheme.replicas.reduce_ops
    assert {o.type for o in reduce} == {"NcclReduceMean"}
    params = ["conv[0]", "conv[1]", "ip[0]", "ip[1]"]
    assert len(reduce) == 2 * len(params)
    by_rank = {r: [o for o in reduce if o.name.startswith(f"nccl/reduce{r}/")] for r in (0, 1)}
    # the backward pass writes ip's gradients before conv's: the chain follows it
    order0 = [o.name.split("/", 2)[2] for o in by_rank[0]]
    order1 = [o.name.split("/", 2)[2] for o in by_rank[1]]
    assert order0 == order1
    assert order0 == ["ip[0]", "ip[1]", "conv[0]", "conv[1]"]
    # rank 0 reduces on the solver's stream of GPU 0, rank 1 on the same thread of GPU 1
    assert {o.location for o in by_rank[0]} == {Location("gpu", 0, 2)}
    assert {o.location for o in by_rank[1]} == {Location("gpu", 1, 2)}
    # each rank's reductions form one chain through its token
    deps = g.dependencies(reduce)
    for ops in by_rank.values():
        for prev, op in zip(ops, ops[1:]):
            assert prev in deps[op]
    # no gradient travels by Copy: only the weights go out to GPU 1 before each pass
    copies = [o for o in s.scheme.replicas.pass_ops if o.type == "Copy"]
    assert copies and all(o.name.startswith("replica1/pull/") for o in copies)
    assert all(o.location.memory == GPU1.memory for o in copies)
    # the update ops follow rank 0's reductions on its stream
    update = [o for o in s.update_ops if o.name.endswith("/update")]
    assert {o.location for o in update} == {Location("gpu", 0, 2)}


def test_two_replicas_on_one_gpu_share_its_weights_on_two_streams(host_memory):
    s = solver(location=GPU0, replicas=2, replica_locations=[Location("gpu", 0, 1)])
    reduce = s.scheme.replicas.reduce_ops
    assert {o.type for o in reduce} == {"AllReduceMean"}
    assert not [o for o in s.scheme.replicas.pass_ops if o.type == "Copy"]  # weights shared
    streams = {o.location for o in s.net.graph.ops if o.location.device == "gpu"}
    assert {Location("gpu", 0, 0), Location("gpu", 0, 1), Location("gpu", 0, 2)} <= streams
    assert all(o.location.device == "gpu" for o in s.net.graph.ops)
