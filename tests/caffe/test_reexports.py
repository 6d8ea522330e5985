"""The names users import from purine.caffe after Caffe's file formats moved to purine.formats
and the op adapter to purine.graph: each old module name is the very module of its new home."""

import importlib

import pytest

import purine.formats
import purine.graph

MOVED = ("caffe_pb2", "prototxt", "upgrade", "caffemodel", "wire", "hdf5_snapshot")


@pytest.mark.parametrize("name", MOVED)
def test_old_module_name_is_the_new_module(name):
    old = importlib.import_module(f"purine.caffe.{name}")
    new = importlib.import_module(f"purine.formats.{name}")
    assert old is new
    assert getattr(importlib.import_module("purine.caffe"), name) is new


def test_names_users_import_still_work():
    from purine.caffe import caffe_pb2
    from purine.caffe.caffemodel import load_weights
    from purine.caffe.layer import Stateful, kernel
    from purine.caffe.prototxt import filter_net, read_net, upgrade_net_input
    from purine.caffe.upgrade import upgrade_net_inputs

    assert caffe_pb2.NetParameter is purine.formats.caffe_pb2.NetParameter
    assert load_weights is purine.formats.caffemodel.load_weights
    assert (kernel, Stateful) == (purine.graph.kernel, purine.graph.Stateful)
    assert filter_net is purine.formats.prototxt.filter_net
    assert upgrade_net_input is purine.formats.upgrade.upgrade_net_input
    assert upgrade_net_inputs is purine.formats.upgrade.upgrade_net_inputs
    net = read_net('name: "n"\ninput: "data" input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4')
    assert [(lp.type, list(lp.input_param.shape[0].dim)) for lp in net.layer] == \
        [("Input", [1, 2, 3, 4])]


def test_pycaffe_proto_is_the_same_module():
    from purine.pycaffe.proto import caffe_pb2

    assert caffe_pb2 is purine.formats.caffe_pb2
