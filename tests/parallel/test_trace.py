"""`train --trace`: one Chrome trace with a track for each worker that does work (dispatcher
workers, the prefetch thread with its per-batch stages, MPI, the parameter server), and over
MPI one trace from rank 0 holding every rank's tracks."""

import json
from collections import defaultdict

from purine.cli import main
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import filter_net, read_net, replace_data_layers
from purine.parallel import build_solver
from purine.runtime.trace import SPANS, Span, chrome_trace, trace_rows
from purine.zoo import model_file
from tests.parallel import test_mpi
from tests.parallel.test_mpi import mpirun, write_solver

launcher, mnist_db = test_mpi.launcher, test_mpi.mnist_db  # the fixtures, shared


def load_trace(path) -> tuple[dict[tuple[int, int], str], list[dict], dict[int, str]]:
    """(pid, tid) -> track name, the complete events, pid -> process name."""
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e["ph"] == "M" and e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "process_name"}
    return tracks, [e for e in events if e["ph"] == "X"], processes


def by_track(tracks, ops) -> dict[tuple[int, str], list[dict]]:
    out = defaultdict(list)
    for e in ops:
        out[e["pid"], tracks[e["pid"], e["tid"]]].append(e)
    return out


def test_top_layer_all_reduce_overlaps_lower_backward(tmp_path):
    net = filter_net(read_net(model_file("bvlc_alexnet/train_val.prototxt")),
                     pb.NetState(phase=pb.TRAIN))
    net = replace_data_layers(net, {"data": (2, 3, 227, 227), "label": (2,)})
    solver = pb.SolverParameter(net_param=net, base_lr=0.01, momentum=0.9, max_iter=1,
                                lr_policy="fixed", random_seed=1)
    s = build_solver(solver, replicas=2)
    s.trace_iteration(tmp_path / "trace.json")
    tracks, ops, processes = load_trace(tmp_path / "trace.json")
    assert len(ops) == len(s.pass_ops() + s.update_ops) and all(e["dur"] >= 0 for e in ops)
    # The replicas' workers, and the thread of the all-reduce and update ops.
    assert sorted(tracks.values()) == ["parameter server", "worker cpu:0/t0",
                                       "worker cpu:0/t1"]
    assert processes == {}  # one process
    events = {e["name"]: e for e in ops}
    fc8 = events["all_reduce/fc8[0]"]
    lower = [events[n] for n in ("conv1/ConvBackwardWeight",
                                 "replica1/conv1/ConvBackwardWeight")]
    # fc8's gradients are exchanged, and fc8 updated, while conv1's backward still runs.
    last = max(e["ts"] + e["dur"] for e in lower)
    update = events["solver/fc8[0]/update"]
    assert fc8["ts"] < last and update["ts"] + update["dur"] < last, (fc8, lower)
    assert tracks[0, fc8["tid"]] == tracks[0, update["tid"]] == "parameter server"


def test_one_process_train_shows_the_worker_and_the_prefetch_stages(tmp_path, mnist_db):
    solver = write_solver(tmp_path, mnist_db, 2, str(tmp_path / "lenet"))
    assert main(["train", "--solver", solver, "--trace", str(tmp_path / "t.json")]) == 0
    tracks, ops, _ = load_trace(tmp_path / "t.json")
    assert list(tracks.values()) == ["worker cpu:0/t0", "prefetch layer 'mnist'"]
    rows = by_track(tracks, ops)
    worker = {e["name"] for e in rows[0, "worker cpu:0/t0"]}
    assert {"mnist/Data", "conv1/ConvForward", "solver/conv1[0]/update"} <= worker
    prefetch = rows[0, "prefetch layer 'mnist'"]
    # Batch 0 is made while the data op waits for it: its span holds the three stages.
    batch = next(e for e in prefetch if e["name"] == "batch 0")
    assert batch["cat"] == "data" and batch["args"] == {"batch": 0}
    inside = [e["name"] for e in prefetch
              if batch["ts"] <= e["ts"] and e["ts"] + e["dur"] <= batch["ts"] + batch["dur"]]
    assert inside == ["read", "decode", "transform", "batch 0"]  # recorded as they end
    data_op = next(e for e in rows[0, "worker cpu:0/t0"] if e["name"] == "mnist/Data")
    assert data_op["ts"] + data_op["dur"] >= batch["ts"] + batch["dur"]


def test_async_parameter_server_has_its_track(tmp_path, mnist_db):
    solver = write_solver(tmp_path, mnist_db, 2, str(tmp_path / "lenet"))
    assert main(["train", "--solver", solver, "--replicas", "2", "--async", "1",
                 "--trace", str(tmp_path / "t.json")]) == 0
    tracks, ops, _ = load_trace(tmp_path / "t.json")
    # The traced push is replica 0's: it computes at thread 1; the server updates at 0.
    assert sorted(tracks.values()) == ["parameter server", "prefetch layer 'mnist' (replica 0)",
                                       "worker cpu:0/t1"]
    server = {e["name"] for e in by_track(tracks, ops)[0, "parameter server"]}
    assert {"replica0/push/conv1[0]", "solver/conv1[0]/update"} <= server, sorted(server)
    assert not any(n.startswith("replica0/conv") for n in server)


def test_two_ranks_write_one_trace_with_a_pid_per_rank(launcher, tmp_path, mnist_db):
    solver = write_solver(tmp_path, mnist_db, 2, str(tmp_path / "lenet"))
    mpirun(launcher, tmp_path, 2, "--solver", solver, "--trace", str(tmp_path / "t.json"))
    tracks, ops, processes = load_trace(tmp_path / "t.json")
    assert processes == {0: "rank 0", 1: "rank 1"}
    for k in (0, 1):
        assert sorted(t for (pid, _), t in tracks.items() if pid == k) == [
            "mpi", "parameter server", f"prefetch layer 'mnist' (replica {k})",
            "worker cpu:0/t0"]
    rows = by_track(tracks, ops)
    # One clock: each all-reduce is a collective, so its spans on the two ranks overlap
    # (to within the barrier's skew).
    exchanges = [{e["name"]: e for e in rows[k, "mpi"]} for k in (0, 1)]
    assert exchanges[0].keys() == exchanges[1].keys() and len(exchanges[0]) == 8
    for name, a in exchanges[0].items():
        b = exchanges[1][name]
        gap = max(a["ts"], b["ts"]) - min(a["ts"] + a["dur"], b["ts"] + b["dur"])
        assert gap < 20e3, (name, a, b)  # microseconds


def test_spans_are_recorded_only_while_on_and_name_each_thread():
    with SPANS.span("before"):
        pass
    SPANS.start()
    with SPANS.span("read", "data", {"batch": 3}):
        pass
    spans = SPANS.stop()
    with SPANS.span("after"):
        pass
    assert [(s.name, s.cat, s.args) for s in spans] == [("read", "data", {"batch": 3})]
    assert spans[0].end >= spans[0].start and not SPANS.on
    # Two threads of one name (two replicas' prefetchers) get two tracks.
    same = [Span("b", "data", "prefetch x", ident, 0.0, 1.0) for ident in (7, 8, 7)]
    trace = chrome_trace(trace_rows([], same))
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert names == ["prefetch x", "prefetch x #2"]
    assert [e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"] == [0, 1, 0]
