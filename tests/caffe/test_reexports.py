"""The names users import from purine.caffe after Caffe's file formats moved to purine.formats
and the op adapter to purine.graph: an old module name is the very module of its new home, and
asking for it by the old path warns with the new one."""

import importlib

import pytest

import purine.caffe
import purine.formats
import purine.graph

MOVED = ("caffe_pb2", "prototxt", "upgrade", "caffemodel", "wire", "hdf5_snapshot")


@pytest.mark.parametrize("name", MOVED)
def test_old_module_name_warns_and_is_the_new_module(name):
    with pytest.warns(DeprecationWarning, match=rf"from purine\.formats import {name}`"):
        old = getattr(purine.caffe, name)
    assert old is importlib.import_module(f"purine.formats.{name}")


def test_old_import_statement_still_works():
    with pytest.warns(DeprecationWarning, match="purine.caffe.caffe_pb2 moved"):
        from purine.caffe import caffe_pb2
    with pytest.warns(DeprecationWarning, match="purine.caffe.prototxt moved"):
        from purine.caffe import prototxt
    assert caffe_pb2.NetParameter is purine.formats.caffe_pb2.NetParameter
    net = prototxt.read_net('name: "n"\ninput: "data" '
                            'input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4')
    assert [(lp.type, list(lp.input_param.shape[0].dim)) for lp in net.layer] == \
        [("Input", [1, 2, 3, 4])]


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'solverstate'"):
        purine.caffe.solverstate  # noqa: B018  (only formats' old residents are forwarded)


def test_op_adapter_names_still_work():
    from purine.caffe.layer import Stateful, kernel

    assert (kernel, Stateful) == (purine.graph.kernel, purine.graph.Stateful)


def test_pycaffe_proto_is_the_same_module():
    from purine.pycaffe.proto import caffe_pb2

    assert caffe_pb2 is purine.formats.caffe_pb2
