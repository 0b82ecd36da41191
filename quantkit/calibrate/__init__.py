"""Calibration: the one layer-by-layer ``walker`` every method runs under, where the activations between
layers live (``activations``), and the host <-> accelerator traffic overlapped with the work (``pipeline``)."""
