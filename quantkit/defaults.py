"""The defaults of ``quantkit.quantize`` and the ``rtn`` / ``gptq`` / ``awq`` commands, and why they are what they are.

Pure data and small pure functions (no model, no torch): :mod:`quantkit.api` applies them, the CLI states them in
``--help``, README's "Defaults, and why" table gives the measurements behind each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantkit.config import CalibConfig, QuantScheme

# The defaults are the best settings measured on SmolLM2 (README, "Quality and speed") that stay cheap
# and that vLLM's and SGLang's fastest kernels serve (README, "Serving the checkpoint"):
# * symmetric for GPTQ and RTN: only symmetric GPTQ checkpoints get Marlin/Machete; asymmetric ones
#   fall back to the float16-only gptq_gemm kernel. AWQ keeps its zero points (asymmetric).
# * GPTQ: act-order with static groups (the column order that helps most, with group scales fixed
#   up front so g_idx stays contiguous and no kernel reorders anything) and the MSE range search, its
#   error weighted per column by the Hessian's diagonal H_jj (squared: the diagonal of GPTQ's objective).
# * GPTQ on an asymmetric grid: act-order with a permuted g_idx (dynamic groups: each group's range is
#   taken from the weights as GPTQ has updated them), the better of the two there. No engine gives
#   asymmetric GPTQ Marlin, and their gptq_gemm serves a permuted g_idx by reordering the activations,
#   so static groups buy nothing there (README, "Defaults, and why").
# * group size: the largest of 128/64/32 dividing every quantized input size (AUTO_GROUP_SIZES).
DEFAULT_SYM = {"rtn": True, "gptq": True, "awq": False}
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "rtn": {},
    "gptq": {"desc_act": True, "static_groups": True, "mse": True, "mse_weight": "hessian"},
    "awq": {},
}
ASYM_DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {"gptq": {"static_groups": False}}


def default_options(method: str, scheme: QuantScheme) -> dict[str, Any]:
    """``method``'s default options for ``scheme`` (``DEFAULT_OPTIONS``, then ``ASYM_DEFAULT_OPTIONS``
    on an asymmetric grid)."""
    options = dict(DEFAULT_OPTIONS.get(method, {}))
    if not scheme.sym:
        options.update(ASYM_DEFAULT_OPTIONS.get(method, {}))
    return options


AUTO_GROUP_SIZES = (128, 64, 32)
# Calibration windows x tokens: GPTQ's usual 128 x 2048 and AWQ's 128 x 512; text the model writes
# itself (``self``) is sized down on the CPU, where generating 128 x 2048 tokens takes over half an
# hour even for a 135M model (calib_data/self_generated.py has the measurements).
DEFAULT_CALIB_SIZE = {"gptq": (128, 2048), "awq": (128, 512), "rtn": (128, 2048)}
SELF_CALIB_CPU_SIZE = (32, 512)


@dataclass(frozen=True)
class AutoScheme:
    """A scheme whose group size is chosen per model by :func:`choose_group_size` (``sym=None``: the
    method's default, ``DEFAULT_SYM``)."""

    bits: int = 4
    sym: bool | None = None

    def resolve(self, method: str, input_sizes: list[int]) -> QuantScheme:
        sym = DEFAULT_SYM.get(method, True) if self.sym is None else self.sym
        return QuantScheme(bits=self.bits, group_size=choose_group_size(input_sizes), sym=sym)


def choose_group_size(input_sizes: list[int]) -> int:
    """The largest of 128/64/32 that divides every size in ``input_sizes``; 128 when none does (the
    last groups are then partial, which the output warns about)."""
    for size in AUTO_GROUP_SIZES:
        if all(n % size == 0 for n in input_sizes):
            return size
    return AUTO_GROUP_SIZES[0]


def default_calibration(method: str, source: str = "self", device: str = "cpu", *, nsamples: int | None = None,
                        seqlen: int | None = None, seed: int = 0, text_field: str = "text") -> CalibConfig:
    """The calibration settings for ``method`` on ``device``; ``nsamples``/``seqlen`` given win."""
    n, length = DEFAULT_CALIB_SIZE.get(method, DEFAULT_CALIB_SIZE["gptq"])
    if source == "self" and not device.startswith("cuda"):
        n, length = SELF_CALIB_CPU_SIZE
    return CalibConfig(source=source, nsamples=n if nsamples is None else nsamples,
                       seqlen=length if seqlen is None else seqlen, seed=seed, text_field=text_field)
