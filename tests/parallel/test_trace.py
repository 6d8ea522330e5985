"""The trace of a 2-replica AlexNet iteration: one track per location, and the gradient
exchange of the top layers runs while the lower layers' backward pass still runs."""

import json

from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import filter_net, read_net, replace_data_layers
from purine.parallel import build_solver
from purine.runtime.trace import chrome_trace
from purine.zoo import model_file


def test_top_layer_all_reduce_overlaps_lower_backward(tmp_path):
    net = filter_net(read_net(model_file("bvlc_alexnet/train_val.prototxt")),
                     pb.NetState(phase=pb.TRAIN))
    net = replace_data_layers(net, {"data": (2, 3, 227, 227), "label": (2,)})
    solver = pb.SolverParameter(net_param=net, base_lr=0.01, momentum=0.9, max_iter=1,
                                lr_policy="fixed", random_seed=1)
    s = build_solver(solver, replicas=2)
    d = s.net.dispatcher
    d.profile = True
    s._iteration()
    events = {e.op.name: e for e in d.trace}
    assert len(d.trace) == len(s._pass_ops() + s.update_ops)
    fc8 = events["all_reduce/fc8[0]"]
    lower = [events[n] for n in ("conv1/ConvBackwardWeight",
                                 "replica1/conv1/ConvBackwardWeight")]
    # fc8's gradients are exchanged, and fc8 updated, while conv1's backward still runs.
    last = max(e.end for e in lower)
    assert fc8.start < last and events["solver/fc8[0]/update"].end < last, (fc8, lower)

    (tmp_path / "trace.json").write_text(json.dumps(chrome_trace(d.trace)))
    trace = json.loads((tmp_path / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert tracks == {"cpu:0/t0", "cpu:0/t1", "cpu:0/t2"}
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(ops) == len(d.trace) and all(e["dur"] >= 0 for e in ops)
