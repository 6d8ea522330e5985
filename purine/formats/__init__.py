"""Caffe's files, at the bottom of the stack: the generated ``caffe_pb2``, prototxt and binary
protobuf readers, the upgrade of old net and solver forms, and the .caffemodel, .binaryproto,
.solverstate and HDF5 snapshot codecs. Nothing here knows layers, graphs or data sources."""
