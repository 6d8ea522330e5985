"""Re-export kept for users: the HDF5 snapshot layout moved to ``purine.formats.hdf5_snapshot``.
This name is bound to that very module, so both names share every function and setting."""

import sys

from purine.formats import hdf5_snapshot as _moved
from purine.formats.hdf5_snapshot import *  # noqa: F403  (the names, for type checkers and readers)

sys.modules[__name__] = _moved
