"""Builders of the data layers (Data, ImageData, MemoryData, HDF5Data)."""
