"""pycaffe's ``caffe.proto`` package: ``from caffe.proto import caffe_pb2`` gives purine's
generated protobuf module (same schema, field names and numbers as BVLC Caffe's)."""

import sys

from purine.formats import caffe_pb2

# ``import purine.pycaffe.proto.caffe_pb2`` finds the very module purine.formats holds, so
# messages made through either name are the same classes.
sys.modules[__name__ + ".caffe_pb2"] = caffe_pb2

__all__ = ["caffe_pb2"]
