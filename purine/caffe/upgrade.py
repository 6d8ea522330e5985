"""Caffe's upgrade of old net formats (V0 and V1 ``layers``) to the current ``layer`` form."""

from __future__ import annotations

from purine.caffe import caffe_pb2 as pb
from purine.errors import ProtoError


def upgrade_net(net: pb.NetParameter) -> pb.NetParameter:
    raise ProtoError(f"net '{net.name}': uses the V1 'layers' field; upgrading it is not "
                     "supported yet")
