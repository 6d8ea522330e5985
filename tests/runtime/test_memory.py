"""The memory planner: exact buffer assignments on hand-built graphs, the dependencies of
blobs that share a buffer, training with shared buffers bit-identical to training without,
and the figure for AlexNet's training iteration."""

import numpy as np
import pytest

from purine.caffe.solver import Solver, read_solver
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb
from purine.formats.prototxt import read_net
from purine.graph import Graph, Location
from purine.parallel import build_solver
from purine.runtime import Dispatcher
from purine.runtime.memory import Buffer, blob_nbytes, plan_memory
from purine.zoo import model_file


def noop(ins, outs):
    pass


def chain(g: Graph, names: list[str], sizes: list[int], dtype: str = "float32"):
    """x -> op0 -> names[0] -> op1 -> names[1] ...: each op reads the last blob, writes
    the next."""
    x = g.blob("x", (4,), dtype)
    prev, blobs = x, []
    for i, (n, s) in enumerate(zip(names, sizes)):
        b = g.blob(n, (s,), dtype)
        g.op(f"op{i}", "T", [prev], [b], noop)
        prev = b
        blobs.append(b)
    return x, blobs


def assignment(plan) -> dict[str, int]:
    return {b.name: key.index for b, key in plan.storage.items()}


# -- hand-built graphs -------------------------------------------------------------------
def test_chain_alternates_two_buffers():
    g = Graph()
    x, (a, b, c, d, out) = chain(g, ["a", "b", "c", "d", "out"], [10, 10, 10, 10, 10])
    plan = plan_memory(g, None, keep=[out])
    # a [0,1], b [1,2], c [2,3], d [3,4]: neighbours overlap at the op between them.
    assert assignment(plan) == {"a": 0, "b": 1, "c": 0, "d": 1}
    assert list(plan.buffer_bytes.values()) == [40, 40]
    assert plan.blob_bytes == 160 and plan.planned_bytes == 80
    assert plan.summary() == "memory plan: 4 blobs in 2 buffers, 0.0 MB instead of 0.0 MB"
    assert x not in plan.storage  # read before any write: its value comes from outside


def test_diamond():
    g = Graph()
    x0 = g.blob("in", (3,))
    x, y, z, w, out = (g.blob(n, (8,)) for n in "xyzw" + "o")
    g.op("a", "T", [x0], [x], noop)       # 0
    g.op("b", "T", [x], [y], noop)        # 1
    g.op("c", "T", [x], [z], noop)        # 2
    g.op("d", "T", [y, z], [w], noop)     # 3
    g.op("e", "T", [w], [out], noop)      # 4
    plan = plan_memory(g, None, keep=[out])
    # x [0,2], y [1,3], z [2,3]: three live at once; w [3,4] reuses x's.
    assert assignment(plan) == {"x": 0, "y": 1, "z": 2, "w": 0}


def test_in_place_op_extends_the_interval():
    g = Graph()
    x0 = g.blob("in", (3,))
    x, y, z = (g.blob(n, (8,)) for n in "xyz")
    g.op("a", "T", [x0], [x], noop)       # 0
    g.op("relu", "T", [x], [x], noop)     # 1: in place
    g.op("b", "T", [x], [y], noop)        # 2
    g.op("c", "T", [y], [z], noop)        # 3
    g.op("d", "T", [z], [x0], noop)       # 4
    plan = plan_memory(g, None, keep=[])
    assert assignment(plan) == {"x": 0, "y": 1, "z": 0}


def test_read_before_write_never_shares():
    """A blob first read, then written (a value from the last iteration, as an
    accumulated diff), and a source nobody writes, keep their own arrays."""
    g = Graph()
    h, src = g.blob("h", (8,)), g.blob("src", (8,))
    t1, t2 = g.blob("t1", (8,)), g.blob("t2", (8,))
    g.op("use", "T", [h, src], [t1], noop)   # 0
    g.op("acc", "T", [t1, h], [h], noop)     # 1
    g.op("t", "T", [t1], [t2], noop)         # 2
    g.op("back", "T", [t2], [src], noop)     # 3: src written after its read
    plan = plan_memory(g, None, keep=[])
    assert assignment(plan) == {"t1": 0, "t2": 1}


def test_keep_is_respected():
    g = Graph()
    _, (a, b, c, d) = chain(g, list("abcd"), [5, 5, 5, 5])
    plan = plan_memory(g, None, keep=[a, d])
    assert assignment(plan) == {"b": 0, "c": 1}


def test_memory_spaces_never_share():
    g = Graph()
    other = Location("cpu", 1)
    x0 = g.blob("in", (4,))
    a = g.blob("a", (4,))
    b = g.blob("b", (4,), location=other)
    c = g.blob("c", (4,), location=other)
    d = g.blob("d", (4,))
    e = g.blob("e", (4,))
    g.op("a", "T", [x0], [a], noop)                  # 0
    g.op("copy", "Copy", [a], [b], noop, other)      # 1
    g.op("b", "T", [b], [c], noop)                   # 2
    g.op("home", "Copy", [c], [d], noop, Location())  # 3
    g.op("e", "T", [d], [e], noop)                   # 4
    plan = plan_memory(g, None, keep=[e])
    # a [0,1] and d [3,4] share; b [1,2] and c [2,3] overlap; c could follow a by time,
    # but lives in another memory space.
    assert assignment(plan) == {"a": 0, "b": 1, "c": 2, "d": 0}
    assert plan.storage[b].location == Location("cpu", 1)
    assert plan.storage[a].location == Location("cpu", 0)


def test_dtype_sizes_bytes_are_bytes():
    g = Graph()
    x0 = g.blob("in", (1,))
    a = g.blob("a", (4,), "float64")     # 32 bytes
    b = g.blob("b", (3,), "float32")     # 12 bytes
    c = g.blob("c", (16,), "float32")    # 64 bytes
    d = g.blob("d", (2, 2), "int8")      # 4 bytes
    g.op("0", "T", [x0], [a], noop)
    g.op("1", "T", [a], [b], noop)
    g.op("2", "T", [b], [c], noop)
    g.op("3", "T", [c], [d], noop)
    g.op("4", "T", [d], [x0], noop)
    plan = plan_memory(g, None, keep=[])
    assert assignment(plan) == {"a": 0, "b": 1, "c": 0, "d": 1}
    # a's 32-byte buffer is grown to c's 64 bytes; b's 12 hold d's 4.
    assert plan.buffer_bytes == {Buffer(Location(), 0): 64, Buffer(Location(), 1): 12}
    assert plan.blob_bytes == 32 + 12 + 64 + 4
    d_ = Dispatcher(g, memory_plan=plan)
    va, vc = d_.array(a), d_.array(c)
    assert va.dtype == np.float64 and va.shape == (4,) and vc.shape == (16,)
    assert np.shares_memory(va, vc)
    vd = d_.array(d)
    assert vd.dtype == np.int8 and vd.shape == (2, 2) and np.shares_memory(vd, d_.array(b))
    assert not np.shares_memory(va, vd)


def test_best_fit_then_the_largest_grown():
    """Four blobs live together, then free; later blobs take the smallest free buffer that
    fits, else the largest free one, grown."""
    g = Graph()
    x0 = g.blob("in", (1,))
    first = [g.blob(f"p{i}", (n,), "int8") for i, n in enumerate([100, 400, 200, 300])]
    g.op("make", "T", [x0], first, noop)                              # 0
    mid = g.blob("mid", (1,), "int8")
    g.op("use", "T", first, [mid], noop)                              # 1
    q = g.blob("q", (150,), "int8")
    g.op("q", "T", [mid], [q], noop)                                  # 2: best fit: p2's 200
    r = g.blob("r", (90,), "int8")
    g.op("r", "T", [mid], [r], noop)                                  # 3: p0's 100
    s = g.blob("s", (350,), "int8")
    g.op("s", "T", [mid], [s], noop)                                  # 4: p1's 400
    t = g.blob("t", (1000,), "int8")
    g.op("t", "T", [mid], [t], noop)                                  # 5: only p3's left
    g.op("end", "T", [q, r, s, t], [x0], noop)                        # 6
    plan = plan_memory(g, None, keep=[mid])
    got = assignment(plan)
    assert got == {"p0": 0, "p1": 1, "p2": 2, "p3": 3, "q": 2, "r": 0, "s": 1, "t": 3}
    assert [plan.buffer_bytes[Buffer(Location(), k)] for k in range(4)] == [100, 400, 200, 1000]


def test_a_value_written_before_a_loop_is_not_reused_inside_it():
    g = Graph()
    x0 = g.blob("in", (4,))
    a, t, v, w = (g.blob(n, (4,)) for n in "atvw")
    g.op("a", "T", [x0], [a], noop)               # 0  a written before the loop
    g.op("t", "T", [a], [t], noop)                # 1  loop [1, 4): a read at 1 only
    g.op("v", "T", [t], [v], noop)                # 2  v could take a's buffer...
    g.op("w", "T", [v], [w], noop)                # 3
    g.op("out", "T", [w], [x0], noop)             # 4
    assert assignment(plan_memory(g, None, keep=[])) == {"a": 0, "t": 1, "v": 0, "w": 1}
    # ...but the second repetition reads a again at op 1: a lives to op 3.
    assert assignment(plan_memory(g, None, keep=[], loops=[(1, 4)])) == {
        "a": 0, "t": 1, "v": 2, "w": 1}
    # A blob first written inside the loop is rewritten by each repetition before its
    # reads: t [1,2] read after the loop is not stretched back over it.
    late = Graph()
    x0 = late.blob("in", (4,))
    a, t, v = (late.blob(n, (4,)) for n in "atv")
    late.op("a", "T", [x0], [a], noop)            # 0  loop [0, 2)
    late.op("t", "T", [a], [t], noop)             # 1
    late.op("v", "T", [t], [v], noop)             # 2  after the loop
    late.op("out", "T", [v], [x0], noop)          # 3
    assert assignment(plan_memory(late, None, keep=[], loops=[(0, 2)])) == {
        "a": 0, "t": 1, "v": 0}


# -- dependencies over shared storage ----------------------------------------------------
def test_dependencies_order_blobs_sharing_a_key_like_one_blob():
    g = Graph()
    a, b, c, d = (g.blob(n, (2,)) for n in "abcd")
    o0 = g.op("w_a", "T", [], [a], noop)
    o1 = g.op("a_to_b", "T", [a], [b], noop)
    o2 = g.op("w_c", "T", [], [c], noop)
    o3 = g.op("cb_to_d", "T", [c, b], [d], noop)
    assert g.dependencies() == {o0: [], o1: [o0], o2: [], o3: [o2, o1]}
    assert g.dependencies(storage=None) == g.dependencies()
    # c lives in a's memory: writing it waits for a's writer (write after write) and a's
    # reader (write after read); d's op reads c, whose last writer is o2.
    shared = g.dependencies(storage={a: "K", c: "K"})
    assert shared == {o0: [], o1: [o0], o2: [o0, o1], o3: [o2, o1]}


def test_dispatcher_refuses_to_bind_a_planned_blob_and_to_plan_a_bound_one():
    g = Graph()
    _, (a, b, c) = chain(g, list("abc"), [3, 3, 3])
    plan = plan_memory(g, None, keep=[c])
    d = Dispatcher(g, memory_plan=plan)
    with pytest.raises(PurineError, match="memory plan"):
        d.bind(a, np.zeros(3, np.float32))
    d2 = Dispatcher(g)
    d2.bind(b, np.zeros(3, np.float32))
    with pytest.raises(PurineError, match="outside storage"):
        d2.set_memory_plan(plan)
    d3 = Dispatcher(g)
    early = d3.array(a)
    d3.set_memory_plan(plan)  # an array made before the plan is re-made from it
    assert d3.array(a) is not early
    assert d3.array(a).base is not None and d3.array(a).base.dtype == np.uint8


# -- training with shared buffers equals training without ----------------------------------
@pytest.fixture(scope="module")
def mnist_db(tmp_path_factory):
    from purine.datasets.mnist import load_mnist_5k, write_mnist_lmdb

    images, labels = load_mnist_5k()
    path = tmp_path_factory.mktemp("mnist") / "train_lmdb"
    write_mnist_lmdb(path, images[:320], labels[:320])
    return str(path)


@pytest.fixture(scope="module")
def cifar_db(tmp_path_factory):
    from purine.converters.convert_imageset import write_images

    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("cifar") / "train_lmdb"
    records = ((f"{i:08d}", rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), i % 10)
               for i in range(160))
    write_images(path, records, total=160)
    return str(path)


def zoo_solver(model: str, solver: str, db: str, batch: int) -> pb.SolverParameter:
    net = read_net(model_file(model))
    for layer in net.layer:
        if layer.type == "Data":
            layer.data_param.source = db
            layer.data_param.batch_size = batch
            layer.transform_param.ClearField("mean_file")
    s = read_solver(model_file(solver))
    s.ClearField("net")
    s.net_param.CopyFrom(net)
    del s.test_iter[:]
    s.test_interval = s.display = s.snapshot = 0
    s.random_seed = 3
    return s


def poison(solver: Solver) -> None:
    """Fill every shared buffer with 0xFF bytes (NaN in floating point): a kernel that
    counted on a fresh, zeroed output would now spread NaNs."""
    d = solver.net.dispatcher
    for b in d.memory_plan.storage:
        d.array(b).reshape(-1).view(np.uint8)[...] = 255


def assert_race_free(graph, ops, storage) -> None:
    """Every two ops touching one storage key, one of them writing, are ordered by the
    derived edges (transitively), so no schedule of the threaded dispatcher can reorder
    them."""
    deps = graph.dependencies(ops, storage)
    index = {o: i for i, o in enumerate(ops)}
    before: list[set[int]] = []
    for o in ops:
        s: set[int] = set()
        for p in deps[o]:
            s |= before[index[p]] | {index[p]}
        before.append(s)
    access: dict = {}
    for i, o in enumerate(ops):
        for b in o.inputs:
            access.setdefault(storage.get(b, b), []).append((i, False))
        for b in o.outputs:
            access.setdefault(storage.get(b, b), []).append((i, True))
    checked = 0
    for key, acc in access.items():
        for n, (i, wi) in enumerate(acc):
            for j, wj in acc[n + 1:]:
                if i != j and (wi or wj):
                    assert i in before[j], f"{ops[i].name} and {ops[j].name} share {key}"
                    checked += 1
    assert checked > 0


NETS = {
    "lenet": ("lenet/lenet_train_test.prototxt", "lenet/lenet_solver.prototxt", "mnist_db", 8),
    "cifar10_quick": ("cifar10_quick/cifar10_quick_train_test.prototxt",
                      "cifar10_quick/cifar10_quick_solver.prototxt", "cifar_db", 4),
}
MODES = {"sequential": {}, "threads3": {"threads": 3}, "iter_size2": {"iter_size": 2},
         "replicas2": {"replicas": 2}}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NETS)
def test_training_with_shared_memory_is_bit_identical(name, mode, request):
    model, solver, db, batch = NETS[name]
    db = request.getfixturevalue(db)
    kw = dict(MODES[mode])
    param = zoo_solver(model, solver, db, batch)
    param.iter_size = kw.pop("iter_size", 1)

    def train(share: bool):
        s = build_solver(param, share_memory=share, **kw)
        if share:
            poison(s)
        losses = [s.iteration() for _ in range(3)]
        return s, losses

    plain, plain_losses = train(False)
    shared, shared_losses = train(True)
    plan = shared.net.dispatcher.memory_plan
    assert plan.planned_bytes < plan.blob_bytes
    assert all(np.isfinite(plain_losses)) and shared_losses == plain_losses
    for layer, views in plain.net.params.items():
        for k, v in enumerate(views):
            assert np.array_equal(shared.net.params[layer][k].data, v.data), f"{layer}[{k}]"
    for h, h2 in zip(plain._history(), shared._history()):
        assert np.array_equal(plain.net.dispatcher.array(h), shared.net.dispatcher.array(h2))
    if mode in ("threads3", "replicas2"):
        ops = shared.pass_ops() + shared.update_ops
        assert len({o.location for o in ops}) >= 3  # the threaded dispatcher ran
        assert_race_free(shared.net.graph, ops, plan.storage)
    if mode == "iter_size2":
        passes = shared.pass_ops() + shared.accumulate_ops
        assert any(plan.storage.get(b) for o in passes for b in o.outputs)
    # The net's outputs and losses survive the iteration (the solver displays them).
    for n in shared.net.outputs:
        assert shared.net.builder.data[n] not in plan.storage


LAYERS_NET = """name: "many"
layer { name: "d" type: "DummyData" top: "x" top: "y" dummy_data_param {
  shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 dim: 5 }
  data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
layer { name: "c1" type: "Convolution" bottom: "x" top: "c1" convolution_param {
  num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "n1" type: "LRN" bottom: "c1" top: "n1" lrn_param { local_size: 3 } }
layer { name: "mp" type: "Pooling" bottom: "n1" top: "mp" pooling_param {
  pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "n2" type: "LRN" bottom: "mp" top: "n2" lrn_param {
  local_size: 3 norm_region: WITHIN_CHANNEL } }
layer { name: "ap" type: "Pooling" bottom: "n2" top: "ap" pooling_param {
  pool: AVE kernel_size: 2 stride: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "ap" top: "bn" }
layer { name: "sc" type: "Scale" bottom: "bn" top: "sc" scale_param { bias_term: true } }
layer { name: "sg" type: "Sigmoid" bottom: "sc" top: "sg" }
layer { name: "th" type: "TanH" bottom: "sc" top: "th" }
layer { name: "el" type: "Eltwise" bottom: "sg" bottom: "th" top: "el"
  eltwise_param { operation: PROD } }
layer { name: "cc" type: "Concat" bottom: "sg" bottom: "el" bottom: "th" top: "cc" }
layer { name: "pr" type: "PReLU" bottom: "cc" top: "cc" }
layer { name: "dc" type: "Deconvolution" bottom: "cc" top: "dc" convolution_param {
  num_output: 2 kernel_size: 2 stride: 2 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "dr" type: "Dropout" bottom: "dc" top: "dc" }
layer { name: "ip" type: "InnerProduct" bottom: "dc" top: "p" inner_product_param {
  num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "p" bottom: "y" top: "loss" }
"""


@pytest.mark.parametrize("threads", [1, 3])
def test_many_layer_types_train_alike_on_poisoned_shared_buffers(threads):
    def train(share: bool):
        s = Solver(pb.SolverParameter(net_param=read_net(LAYERS_NET), base_lr=0.05,
                                      momentum=0.9, lr_policy="fixed", random_seed=5,
                                      max_iter=3), threads=threads, share_memory=share)
        if share:
            poison(s)
        return s, [s.iteration() for _ in range(3)]

    plain, plain_losses = train(False)
    shared, shared_losses = train(True)
    assert len(shared.net.dispatcher.memory_plan.buffer_bytes) > 1
    assert all(np.isfinite(plain_losses)) and shared_losses == plain_losses
    for layer, views in plain.net.params.items():
        for k, v in enumerate(views):
            assert np.array_equal(shared.net.params[layer][k].data, v.data), f"{layer}[{k}]"


def test_alexnet_batch_256_figure(capsys):
    """The plan of AlexNet's training iteration at batch 256 (data from Input blobs), made
    without running or allocating any activation."""
    net = read_net(model_file("bvlc_alexnet/train_val.prototxt"))
    layers = [layer for layer in net.layer if layer.type != "Data"]
    del net.layer[:]
    data = net.layer.add(name="data", type="Input", top=["data", "label"])
    data.input_param.shape.add(dim=[256, 3, 227, 227])
    data.input_param.shape.add(dim=[256])
    net.layer.extend(layers)
    param = read_solver(model_file("bvlc_alexnet/solver.prototxt"))
    param.ClearField("net")
    param.net_param.CopyFrom(net)
    del param.test_iter[:]
    param.test_interval = 0
    s = Solver(param, share_memory=True)
    d = s.net.dispatcher
    assert {b for b in d.arrays} == set(s.net.builder.learnable_params)  # weights only
    plan = d.memory_plan
    blobs = s.net.graph.blobs
    assert blobs["conv1"] in plan.storage and blobs["fc6[0]@diff"] in plan.storage
    assert blobs["data"] not in plan.storage  # Input tops are written from outside
    assert plan.planned_bytes < 0.8 * plan.blob_bytes
    everything = sum(blob_nbytes(b) for b in blobs.values())
    with capsys.disabled():
        print(f"\nAlexNet batch 256, one training iteration: {plan.summary()}; all blobs "
              f"{everything / 1e6:.1f} MB unplanned, "
              f"{(everything - plan.blob_bytes + plan.planned_bytes) / 1e6:.1f} MB planned")
