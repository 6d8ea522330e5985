"""Caffe's data sources for the data layers: LMDB and LevelDB databases of Datum records,
image lists, R-CNN window files, HDF5 files and arrays fed from Python; Datum decoding,
Caffe's DataTransformer applied to whole batches, and the background prefetching that
overlaps reading with computation."""

from purine.errors import PurineError


class DataError(PurineError):
    """A database, file or record a data layer cannot use; the message names the file and
    the record (key, list line) and what was expected."""
