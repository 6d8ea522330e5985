"""Re-export kept for users: Caffe's generated protobuf module moved to
``purine.formats.caffe_pb2``. This name is bound to that very module, so both names share
every function and setting."""

import sys

from purine.formats import caffe_pb2 as _moved
from purine.formats.caffe_pb2 import *  # noqa: F403  (the names, for type checkers and readers)

sys.modules[__name__] = _moved
