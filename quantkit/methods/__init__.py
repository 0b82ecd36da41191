"""Quantization methods: each a pure-tensor core plus the small class the walker calls."""
