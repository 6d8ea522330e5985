"""purine-caffe: Caffe's nets and solvers as bi-graphs of blobs and ops (arXiv 1412.6249)."""

__version__ = "0.1.0"
