"""quantkit: post-training 4-bit quantization of LLMs into packed INT4 checkpoints.

The public API lives in :mod:`quantkit.api`; its main functions are re-exported here lazily so that
``import quantkit`` stays cheap (no torch or transformers import until one is used).
"""

from __future__ import annotations

from quantkit.version import __version__

_API = ("quantize", "load_quantized", "evaluate_perplexity", "inspect", "build_method", "QuantizeReport")
_CONFIG = ("QuantScheme", "CalibConfig", "LoadConfig", "QuantkitError")

__all__ = [*_API, *_CONFIG, "__version__"]


def __getattr__(name: str):
    if name in _API:
        from quantkit import api

        return getattr(api, name)
    if name in _CONFIG:
        from quantkit import config

        return getattr(config, name)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
