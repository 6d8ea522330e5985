"""Re-export kept for users: the prototxt and binary protobuf readers, NetState rules and
implicit splits moved to ``purine.formats.prototxt``. This name is bound to that very module,
so both names share every function and setting."""

import sys

from purine.formats import prototxt as _moved
from purine.formats.prototxt import *  # noqa: F403  (the names, for type checkers and readers)

sys.modules[__name__] = _moved
