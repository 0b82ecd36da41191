"""Calibration: the one layer-by-layer ``walker`` every method runs under (its records in ``records``, running a
layer on its calibration batches in ``capture``), where the activations between layers live (``activations``),
and the host <-> accelerator traffic overlapped with the work (``pipeline``)."""
