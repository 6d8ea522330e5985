"""Re-export kept for users: the .caffemodel and BlobProto codecs moved to
``purine.formats.caffemodel``. This name is bound to that very module, so both names share
every function and setting."""

import sys

from purine.formats import caffemodel as _moved
from purine.formats.caffemodel import *  # noqa: F403  (the names, for type checkers and readers)

sys.modules[__name__] = _moved
