"""Tools around the library, not part of a quantization or serving path: ``verify`` (the runtime against an
independent reader), ``bench`` / ``bench_run`` (decode speed), ``kernel_plan`` (which kernels a checkpoint runs)."""
