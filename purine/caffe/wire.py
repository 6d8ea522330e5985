"""Re-export kept for users: the hand-written protobuf wire format moved to
``purine.formats.wire``. This name is bound to that very module, so both names share every
function and setting."""

import sys

from purine.formats import wire as _moved
from purine.formats.wire import *  # noqa: F403  (the names, for type checkers and readers)

sys.modules[__name__] = _moved
