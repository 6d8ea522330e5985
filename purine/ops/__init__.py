"""Kernels: plain functions over arrays, ``fn(*inputs, *outputs, **params)``, that fill their
outputs in place. One family per module; forward and backward side by side; written once
over the array module of their arguments (numpy or cupy)."""
