"""The methods by name: ``build_method`` makes the method object the walker runs, with its config built from
option names (the CLI's, a batch recipe's) over the measured defaults (:mod:`quantkit.defaults`)."""

from __future__ import annotations

from typing import Any

from quantkit.calibrate.walker import Method
from quantkit.config import QuantkitError, QuantScheme
from quantkit.defaults import default_options

METHOD_NAMES = ("rtn", "gptq", "awq", "fp8")  # fp8: quantkit.fp8_api drives it (the scheme is unused)


def build_method(name: str, scheme: QuantScheme, options: dict[str, Any] | None = None) -> Method:
    """The method object for ``name`` with its own config built from ``options`` (CLI option names)."""
    options = {**default_options(name, scheme), **(options or {})}
    if name == "rtn":
        from quantkit.methods.rtn import RTNMethod

        if options:
            raise QuantkitError(f"rtn takes no options, got {sorted(options)}")
        return RTNMethod(scheme)
    if name == "gptq":
        from quantkit.methods.gptq import GPTQConfig
        from quantkit.methods.gptq_method import GPTQMethod

        return GPTQMethod(scheme, GPTQConfig(**options))
    if name == "awq":
        from quantkit.methods.awq import AWQConfig
        from quantkit.methods.awq_method import AWQMethod

        return AWQMethod(scheme, AWQConfig(**options))
    if name == "fp8":
        from quantkit.methods.fp8 import FP8Method, fp8_config

        return FP8Method(fp8_config(options))
    raise QuantkitError(f"unknown method {name!r}; choose one of {', '.join(METHOD_NAMES)}")
