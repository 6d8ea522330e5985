"""Caffe's upgrade of old file forms (util/upgrade_proto.cpp): V0 nets (``layers { layer {} }``
with padding layers), V1 nets (``layers { type: ENUM }``), data layers' old transformation
fields, BatchNorm's old param specs, the net-level inputs, and the solver_type enum."""

from __future__ import annotations

from google.protobuf import message

from purine.errors import ProtoError
from purine.formats import caffe_pb2 as pb
from purine.log import get_logger

V1 = pb.V1LayerParameter

V1_TYPE_NAMES: dict[int, str] = {
    V1.NONE: "", V1.ABSVAL: "AbsVal", V1.ACCURACY: "Accuracy", V1.ARGMAX: "ArgMax",
    V1.BNLL: "BNLL", V1.CONCAT: "Concat", V1.CONTRASTIVE_LOSS: "ContrastiveLoss",
    V1.CONVOLUTION: "Convolution", V1.DECONVOLUTION: "Deconvolution", V1.DATA: "Data",
    V1.DROPOUT: "Dropout", V1.DUMMY_DATA: "DummyData", V1.EUCLIDEAN_LOSS: "EuclideanLoss",
    V1.ELTWISE: "Eltwise", V1.EXP: "Exp", V1.FLATTEN: "Flatten", V1.HDF5_DATA: "HDF5Data",
    V1.HDF5_OUTPUT: "HDF5Output", V1.HINGE_LOSS: "HingeLoss", V1.IM2COL: "Im2col",
    V1.IMAGE_DATA: "ImageData", V1.INFOGAIN_LOSS: "InfogainLoss",
    V1.INNER_PRODUCT: "InnerProduct", V1.LRN: "LRN", V1.MEMORY_DATA: "MemoryData",
    V1.MULTINOMIAL_LOGISTIC_LOSS: "MultinomialLogisticLoss", V1.MVN: "MVN",
    V1.POOLING: "Pooling", V1.POWER: "Power", V1.RELU: "ReLU", V1.SIGMOID: "Sigmoid",
    V1.SIGMOID_CROSS_ENTROPY_LOSS: "SigmoidCrossEntropyLoss", V1.SILENCE: "Silence",
    V1.SOFTMAX: "Softmax", V1.SOFTMAX_LOSS: "SoftmaxWithLoss", V1.SPLIT: "Split",
    V1.SLICE: "Slice", V1.TANH: "TanH", V1.WINDOW_DATA: "WindowData",
    V1.THRESHOLD: "Threshold",
}
"""The V1 LayerType enum -> the layer type string (Caffe's UpgradeV1LayerType)."""

V0_TYPES: dict[str, int] = {
    "accuracy": V1.ACCURACY, "bnll": V1.BNLL, "concat": V1.CONCAT, "conv": V1.CONVOLUTION,
    "data": V1.DATA, "dropout": V1.DROPOUT, "euclidean_loss": V1.EUCLIDEAN_LOSS,
    "flatten": V1.FLATTEN, "hdf5_data": V1.HDF5_DATA, "hdf5_output": V1.HDF5_OUTPUT,
    "im2col": V1.IM2COL, "images": V1.IMAGE_DATA, "infogain_loss": V1.INFOGAIN_LOSS,
    "innerproduct": V1.INNER_PRODUCT, "lrn": V1.LRN,
    "multinomial_logistic_loss": V1.MULTINOMIAL_LOGISTIC_LOSS, "pool": V1.POOLING,
    "relu": V1.RELU, "sigmoid": V1.SIGMOID, "softmax": V1.SOFTMAX,
    "softmax_loss": V1.SOFTMAX_LOSS, "split": V1.SPLIT, "tanh": V1.TANH,
    "window_data": V1.WINDOW_DATA,
}
"""The V0 type string -> the V1 LayerType enum (Caffe's UpgradeV0LayerType)."""

# V0 field -> {V0 type: (V1 *_param field, its field)}. A V0 field set on a type not listed
# is dropped with a warning, as Caffe drops it ("not fully compatible").
_CONV, _IP, _POOL = "convolution_param", "inner_product_param", "pooling_param"
_DATA, _HDF5, _IMAGES, _WINDOW = ("data_param", "hdf5_data_param", "image_data_param",
                                  "window_data_param")
_V0_FIELDS: dict[str, dict[str, tuple[str, str]]] = {
    "num_output": {"conv": (_CONV, "num_output"), "innerproduct": (_IP, "num_output")},
    "biasterm": {"conv": (_CONV, "bias_term"), "innerproduct": (_IP, "bias_term")},
    "weight_filler": {"conv": (_CONV, "weight_filler"), "innerproduct": (_IP, "weight_filler")},
    "bias_filler": {"conv": (_CONV, "bias_filler"), "innerproduct": (_IP, "bias_filler")},
    "pad": {"conv": (_CONV, "pad"), "pool": (_POOL, "pad")},
    "kernelsize": {"conv": (_CONV, "kernel_size"), "pool": (_POOL, "kernel_size")},
    "group": {"conv": (_CONV, "group")},
    "stride": {"conv": (_CONV, "stride"), "pool": (_POOL, "stride")},
    "pool": {"pool": (_POOL, "pool")},  # V0's PoolMethod numbers are PoolingParameter's
    "dropout_ratio": {"dropout": ("dropout_param", "dropout_ratio")},
    "local_size": {"lrn": ("lrn_param", "local_size")},
    "alpha": {"lrn": ("lrn_param", "alpha")},
    "beta": {"lrn": ("lrn_param", "beta")},
    "k": {"lrn": ("lrn_param", "k")},
    "source": {"data": (_DATA, "source"), "hdf5_data": (_HDF5, "source"),
               "images": (_IMAGES, "source"), "window_data": (_WINDOW, "source"),
               "infogain_loss": ("infogain_loss_param", "source")},
    "batchsize": {"data": (_DATA, "batch_size"), "hdf5_data": (_HDF5, "batch_size"),
                  "images": (_IMAGES, "batch_size"), "window_data": (_WINDOW, "batch_size")},
    "rand_skip": {"data": (_DATA, "rand_skip"), "images": (_IMAGES, "rand_skip")},
    "shuffle_images": {"images": (_IMAGES, "shuffle")},
    "new_height": {"images": (_IMAGES, "new_height")},
    "new_width": {"images": (_IMAGES, "new_width")},
    "concat_dim": {"concat": ("concat_param", "concat_dim")},
    "det_fg_threshold": {"window_data": (_WINDOW, "fg_threshold")},
    "det_bg_threshold": {"window_data": (_WINDOW, "bg_threshold")},
    "det_fg_fraction": {"window_data": (_WINDOW, "fg_fraction")},
    "det_context_pad": {"window_data": (_WINDOW, "context_pad")},
    "det_crop_mode": {"window_data": (_WINDOW, "crop_mode")},
    "hdf5_output_param": {"hdf5_output": ("hdf5_output_param", "")},  # the whole message
}
# ConvolutionParameter's geometry fields are repeated (one value per spatial axis).
_REPEATED = {(_CONV, "pad"), (_CONV, "kernel_size"), (_CONV, "stride")}
# V0 transformation fields go to transform_param whatever the layer type.
_V0_TRANSFORM = {"scale": "scale", "meanfile": "mean_file", "cropsize": "crop_size",
                 "mirror": "mirror"}

# Data layers whose own *_param carried the transformation fields before transform_param.
_DATA_TRANSFORM_PARAMS = {V1.DATA: _DATA, V1.IMAGE_DATA: _IMAGES, V1.WINDOW_DATA: _WINDOW}
_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")

SOLVER_TYPE_NAMES: dict[int, str] = {
    pb.SolverParameter.SGD: "SGD", pb.SolverParameter.NESTEROV: "Nesterov",
    pb.SolverParameter.ADAGRAD: "AdaGrad", pb.SolverParameter.RMSPROP: "RMSProp",
    pb.SolverParameter.ADADELTA: "AdaDelta", pb.SolverParameter.ADAM: "Adam",
}
"""The deprecated SolverParameter.solver_type enum -> the ``type`` string."""


# -- what needs upgrading --------------------------------------------------------------------
def net_needs_v0_upgrade(net: pb.NetParameter) -> bool:
    return any(layer.HasField("layer") for layer in net.layers)


def net_needs_data_upgrade(net: pb.NetParameter) -> bool:
    """A V1 data layer with scale/mean_file/crop_size/mirror in its own *_param."""
    for layer in net.layers:
        field = _DATA_TRANSFORM_PARAMS.get(layer.type)
        if field and any(getattr(layer, field).HasField(f) for f in _TRANSFORM_FIELDS):
            return True
    return False


def net_needs_batch_norm_upgrade(net: pb.NetParameter) -> bool:
    """A BatchNorm layer declaring three param specs, as the first BatchNorm layer required."""
    return any(layer.type == "BatchNorm" and len(layer.param) == 3 for layer in net.layer)


def net_needs_upgrade(net: pb.NetParameter) -> bool:
    """Whether any of Caffe's net upgrades (input fields included) would change ``net``."""
    return (bool(net.layers) or net_needs_data_upgrade(net) or bool(net.input)
            or net_needs_batch_norm_upgrade(net))


# -- the whole upgrade -------------------------------------------------------------------------
def upgrade_net(net: pb.NetParameter, problems: list[str] | None = None) -> pb.NetParameter:
    """A copy of ``net`` in the current form: V0 -> V1, data transformation fields, V1 -> V2,
    BatchNorm param specs (Caffe's UpgradeNetAsNeeded). The net-level ``input`` fields stay
    for ``upgrade_net_input``, which read_net applies next.

    What Caffe upgrades with a warning and goes on ("not fully compatible": a V0 field the
    layer type has no use for, ``layer`` entries beside V1 ``layers``) is appended to
    ``problems`` when a list is given, else logged as a warning. What Caffe stops on (an
    unknown V0 or V1 type, a padding layer feeding a layer that cannot take its pad) raises a
    ProtoError naming the net and the layer."""
    out = pb.NetParameter()
    out.CopyFrom(net)
    found: list[str] = []
    if net_needs_v0_upgrade(out):
        out = upgrade_v0_net(out, found)
    if net_needs_data_upgrade(out):
        upgrade_net_data_transformation(out)
    if out.layers:
        out = upgrade_v1_net(out, found)
    if net_needs_batch_norm_upgrade(out):
        upgrade_net_batch_norm(out)
    if problems is not None:
        problems.extend(found)
    else:
        log = get_logger()
        for p in found:
            log.warning("%s", p)
    return out


def upgrade_net_inputs(net: pb.NetParameter) -> pb.NetParameter:
    """Caffe's UpgradeNetInput, in place: ``input`` with ``input_shape`` or ``input_dim``
    becomes an Input layer at the front; ``input`` alone (how old caffemodels record a deploy
    net's inputs) is simply dropped."""
    if net.input and not net.input_shape and not net.input_dim:
        net.ClearField("input")
        return net
    return upgrade_net_input(net)


def upgrade_net_input(net: pb.NetParameter) -> pb.NetParameter:
    """Turn the deprecated net-level ``input``/``input_shape``/``input_dim`` fields into an
    Input layer named "input" at the front, as Caffe's upgrade does."""
    if not net.input:
        return net
    layer = pb.LayerParameter(name="input", type="Input", top=list(net.input))
    if net.input_shape:
        if len(net.input_shape) != len(net.input):
            raise ProtoError(f"net '{net.name}': {len(net.input)} inputs but "
                             f"{len(net.input_shape)} input_shape entries")
        layer.input_param.shape.extend(net.input_shape)
    elif net.input_dim:
        if len(net.input_dim) != 4 * len(net.input):
            raise ProtoError(f"net '{net.name}': input_dim needs 4 values per input, got "
                             f"{len(net.input_dim)} for {len(net.input)} inputs")
        for i in range(len(net.input)):
            layer.input_param.shape.add(dim=net.input_dim[4 * i: 4 * i + 4])
    else:
        raise ProtoError(f"net '{net.name}': input blobs without input_shape or input_dim")
    layers = list(net.layer)
    del net.layer[:]
    net.layer.add().CopyFrom(layer)
    net.layer.extend(layers)
    net.ClearField("input")
    net.ClearField("input_shape")
    net.ClearField("input_dim")
    return net


def _where(net: pb.NetParameter, name: str, index: int) -> str:
    return f"net '{net.name}': layer '{name}'" if name else \
        f"net '{net.name}': layer {index} (unnamed)"


# -- V0 -> V1 ---------------------------------------------------------------------------------
def upgrade_v0_padding_layers(net: pb.NetParameter) -> pb.NetParameter:
    """A copy of a V0 net without its padding layers: each pad moves into the conv or pool
    layer that reads the padding layer's top, which reads the padding layer's bottom."""
    out = pb.NetParameter()
    out.CopyFrom(net)
    del out.layers[:]
    last_top: dict[str, int] = {name: -1 for name in net.input}  # -1: a net input
    for i, conn in enumerate(net.layers):
        v0 = conn.layer
        if v0.type != "padding":
            out.layers.add().CopyFrom(conn)
        for j, blob in enumerate(conn.bottom):
            if blob not in last_top:
                raise ProtoError(f"{_where(net, v0.name, i)}: unknown bottom blob '{blob}' "
                                 f"(bottom {j}); no net input or earlier layer has it as a top")
            src_index = last_top[blob]
            if src_index < 0:
                continue
            src = net.layers[src_index]
            if src.layer.type != "padding":
                continue
            if v0.type not in ("conv", "pool"):
                raise ProtoError(f"{_where(net, v0.name, i)}: padding layer "
                                 f"'{src.layer.name}' feeds a layer of V0 type '{v0.type}'; "
                                 "only conv and pool layers can take its pad")
            if len(conn.bottom) != 1:
                raise ProtoError(f"{_where(net, v0.name, i)}: a {v0.type} layer fed by padding "
                                 f"layer '{src.layer.name}' takes one bottom, it has "
                                 f"{len(conn.bottom)}")
            if len(src.bottom) != 1 or len(src.top) != 1:
                raise ProtoError(f"{_where(net, src.layer.name, src_index)}: a padding layer "
                                 f"takes one bottom and makes one top, it has "
                                 f"{len(src.bottom)} and {len(src.top)}")
            new = out.layers[-1]
            new.layer.pad = src.layer.pad
            new.bottom[j] = src.bottom[0]
        for blob in conn.top:
            last_top[blob] = i
    return out


def upgrade_v0_net(net: pb.NetParameter, problems: list[str]) -> pb.NetParameter:
    """Caffe's UpgradeV0Net: padding layers folded, every V0 layer -> a V1 layer. Only the
    name, inputs, input_dim and force_backward of the net carry over, as in Caffe."""
    padded = upgrade_v0_padding_layers(net)
    out = pb.NetParameter()
    if padded.HasField("name"):
        out.name = padded.name
    for i, conn in enumerate(padded.layers):
        out.layers.add().CopyFrom(upgrade_v0_layer(conn, padded, i, problems))
    out.input.extend(padded.input)
    out.input_dim.extend(padded.input_dim)
    if padded.HasField("force_backward"):
        out.force_backward = padded.force_backward
    return out


def upgrade_v0_layer(conn: pb.V1LayerParameter, net: pb.NetParameter, index: int,
                     problems: list[str]) -> pb.V1LayerParameter:
    """One V0 layer (``layers { layer {...} bottom top }``) as a V1 layer."""
    out = pb.V1LayerParameter(bottom=list(conn.bottom), top=list(conn.top))
    if not conn.HasField("layer"):
        # Caffe keeps only the connections of such an entry in a V0 net.
        problems.append(f"{_where(net, conn.name, index)}: a V1 layer in a V0 net; only its "
                        "bottoms and tops are kept")
        return out
    v0 = conn.layer
    where = _where(net, v0.name, index)
    if v0.HasField("name"):
        out.name = v0.name
    if v0.HasField("type"):
        if v0.type not in V0_TYPES:
            raise ProtoError(f"{where}: unknown V0 layer type '{v0.type}'; known types: "
                             + ", ".join(sorted(V0_TYPES)))
        out.type = V0_TYPES[v0.type]
    out.blobs.extend(v0.blobs)
    out.blobs_lr.extend(v0.blobs_lr)
    out.weight_decay.extend(v0.weight_decay)
    for field, targets in _V0_FIELDS.items():
        if not v0.HasField(field):
            continue
        if v0.type not in targets:
            problems.append(f"{where}: V0 parameter {field} does not apply to V0 "
                            f"type '{v0.type}'; dropped")
            continue
        param_name, target = targets[v0.type]
        param = getattr(out, param_name)
        value = getattr(v0, field)
        if not target:
            param.CopyFrom(value)
        elif isinstance(value, message.Message):
            getattr(param, target).CopyFrom(value)
        elif (param_name, target) in _REPEATED:
            getattr(param, target).append(value)
        else:
            setattr(param, target, value)
    for field, target in _V0_TRANSFORM.items():
        if v0.HasField(field):
            setattr(out.transform_param, target, getattr(v0, field))
    return out


# -- data transformation fields ---------------------------------------------------------------
def upgrade_net_data_transformation(net: pb.NetParameter) -> None:
    """Move scale/mean_file/crop_size/mirror of V1 Data, ImageData and WindowData layers from
    their own *_param into transform_param (in place)."""
    for layer in net.layers:
        field = _DATA_TRANSFORM_PARAMS.get(layer.type)
        if not field:
            continue
        param = getattr(layer, field)
        for f in _TRANSFORM_FIELDS:
            if param.HasField(f):
                setattr(layer.transform_param, f, getattr(param, f))
                param.ClearField(f)


# -- V1 -> V2 ---------------------------------------------------------------------------------
def upgrade_v1_net(net: pb.NetParameter, problems: list[str]) -> pb.NetParameter:
    """Caffe's UpgradeV1Net: every V1 ``layers`` entry -> a ``layer``; the rest of the net is
    kept. ``layer`` entries beside the ``layers`` ones are dropped, as Caffe drops them."""
    out = pb.NetParameter()
    out.CopyFrom(net)
    del out.layers[:]
    if out.layer:
        problems.append(f"net '{net.name}': has both V1 'layers' and current 'layer' "
                        f"entries; the {len(out.layer)} 'layer' entries are ignored")
        del out.layer[:]
    for i, v1 in enumerate(net.layers):
        out.layer.add().CopyFrom(upgrade_v1_layer(v1, net, i, problems))
    return out


def upgrade_v1_layer(v1: pb.V1LayerParameter, net: pb.NetParameter, index: int,
                     problems: list[str]) -> pb.LayerParameter:
    """One V1 layer as a LayerParameter: the type enum as its string, blobs_lr/weight_decay/
    param/blob_share_mode as ParamSpecs, the *_param messages copied, blobs carried."""
    where = _where(net, v1.name, index)
    out = pb.LayerParameter(bottom=list(v1.bottom), top=list(v1.top))
    if v1.HasField("name"):
        out.name = v1.name
    out.include.extend(v1.include)
    out.exclude.extend(v1.exclude)
    if v1.HasField("type"):
        if v1.type not in V1_TYPE_NAMES:
            raise ProtoError(f"{where}: unknown V1 layer type {v1.type}")
        out.type = V1_TYPE_NAMES[v1.type]
    out.blobs.extend(v1.blobs)

    def spec(i: int) -> pb.ParamSpec:
        while len(out.param) <= i:
            out.param.add()
        return out.param[i]

    for i, name in enumerate(v1.param):
        spec(i).name = name
    for i, mode in enumerate(v1.blob_share_mode):
        spec(i).share_mode = mode  # V1's DimCheckMode numbers are ParamSpec's
    for i, lr in enumerate(v1.blobs_lr):
        spec(i).lr_mult = lr
    for i, decay in enumerate(v1.weight_decay):
        spec(i).decay_mult = decay
    out.loss_weight.extend(v1.loss_weight)
    for field, value in v1.ListFields():
        if field.name.endswith("_param"):  # every *_param of V1 has its namesake in V2
            getattr(out, field.name).CopyFrom(value)
    if v1.HasField("layer"):
        problems.append(f"{where}: has a V0 'layer' message beside its V1 fields; ignored")
    return out


# -- BatchNorm --------------------------------------------------------------------------------
def upgrade_net_batch_norm(net: pb.NetParameter) -> None:
    """BatchNorm layers that declare three param specs (the first BatchNorm definition asked
    for them) get lr_mult and decay_mult 0 in each, other fields kept (in place)."""
    for layer in net.layer:
        if layer.type == "BatchNorm" and len(layer.param) == 3:
            for spec in layer.param:
                spec.lr_mult = 0.0
                spec.decay_mult = 0.0


# -- solver -----------------------------------------------------------------------------------
def solver_needs_upgrade(param: pb.SolverParameter) -> bool:
    return param.HasField("solver_type")


def upgrade_solver(param: pb.SolverParameter, where: str = "solver") -> pb.SolverParameter:
    """A copy of ``param`` with the deprecated ``solver_type`` enum as the ``type`` string
    (Caffe's UpgradeSolverType); giving both fields is an error, as in Caffe, that starts
    with ``where`` (the file)."""
    out = pb.SolverParameter()
    out.CopyFrom(param)
    if not out.HasField("solver_type"):
        return out
    if out.HasField("type"):
        old = pb.SolverParameter.SolverType.Name(out.solver_type)
        raise ProtoError(f"{where}: both the old solver_type field ({old}) and the new type "
                         f"field ('{out.type}') are given; keep only type")
    out.type = SOLVER_TYPE_NAMES[out.solver_type]
    out.ClearField("solver_type")
    return out
