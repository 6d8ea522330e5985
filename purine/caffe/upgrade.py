"""Re-export kept for users: the upgrade of old net and solver forms moved to
``purine.formats.upgrade``. This name is bound to that very module, so both names share every
function and setting."""

import sys

from purine.formats import upgrade as _moved
from purine.formats.upgrade import *  # noqa: F403  (the names, for type checkers and readers)

sys.modules[__name__] = _moved
