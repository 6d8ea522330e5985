"""Hypothesis fuzzing of the files a Caffe user hands the project: prototxt nets and solvers,
caffemodels, binaryproto means, solverstates and Datum records. Every outcome must be success
or one line of the project's own error naming the file (see harness.check)."""
