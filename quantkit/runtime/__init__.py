"""The serving runtime: a compact decoder over quantkit's kernels, a KV cache, continuous batching,
CUDA-graph decode, and the HTTP server. ``quantkit.runtime.types`` holds the records it exchanges."""
