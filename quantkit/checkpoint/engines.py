"""Which vLLM / SGLang kernel will serve a checkpoint, from its bits, group size, symmetry and act-order.

Pure and table-driven (no torch): the CLI prints the answer after quantizing, README shows the table.
The rules were read from the engines' source (paths in README, "Serving the checkpoint"):

* GPTQ layout, symmetric, 4 or 8 bits, group size -1/32/64/128: both engines convert it to
  ``gptq_marlin`` (``GPTQMarlinConfig.TYPE_MAP`` holds only ``(4, True)`` and ``(8, True)``). vLLM then
  picks Machete on Hopper when it can implement the layer (16-bit activations, group -1/64/128,
  in_features % 64, out_features % 128), else Marlin. Act-order (a permuted ``g_idx``) is served by
  both, through a sorted ``g_idx`` / permuted activations.
* GPTQ layout, asymmetric (zero points) or 2/3 bits: ``gptq_marlin`` refuses it and both fall back to
  the ``gptq`` method, whose ``gptq_gemm`` (ExLlama v1 lineage) kernel takes float16 activations only.
* AWQ layout (4 bits, zero points): vLLM's ``awq_marlin`` (Marlin with zero points), same group sizes.
* A group size that does not divide every quantized input size (quantkit's partial last group) is
  refused by every loader above: they allocate ``input_size // group_size`` scale rows.
"""

from __future__ import annotations

from dataclasses import dataclass

MARLIN_GROUP_SIZES = (-1, 32, 64, 128)
MACHETE_GROUP_SIZES = (-1, 64, 128)
MARLIN_GPTQ_BITS = (4, 8)  # symmetric only
ENGINES = ("vLLM", "SGLang")


@dataclass(frozen=True)
class CheckpointTraits:
    """What decides an engine's kernel: ``act_order`` is a permuted g_idx (``desc_act: true`` in the
    config); ``partial_groups`` is true when some quantized input size is not a multiple of the group size."""

    bits: int
    group_size: int
    sym: bool
    act_order: bool = False
    partial_groups: bool = False
    layout: str = "gptq"

    def __post_init__(self) -> None:
        if self.layout not in ("gptq", "awq"):
            raise ValueError(f"layout must be gptq or awq, got {self.layout!r}")


def engine_kernels(traits: CheckpointTraits) -> dict[str, str]:
    """``{"vLLM": kernel, "SGLang": kernel}``: a short phrase naming the kernel (or why it is refused)."""
    if traits.partial_groups:
        refused = (f"refused: group size {traits.group_size} does not divide every input size "
                   "(use a group size that does)")
        return {engine: refused for engine in ENGINES}
    if traits.layout == "awq":
        if traits.bits == 4 and traits.group_size in MARLIN_GROUP_SIZES:
            return {"vLLM": "awq_marlin (Marlin with zero points)", "SGLang": "awq_marlin (Marlin with zero points)"}
        return {engine: "awq (AWQ GEMM kernel, float16 only)" for engine in ENGINES}
    marlin = traits.sym and traits.bits in MARLIN_GPTQ_BITS and traits.group_size in MARLIN_GROUP_SIZES
    if not marlin:
        why = "asymmetric" if not traits.sym else f"{traits.bits}-bit" if traits.bits not in MARLIN_GPTQ_BITS \
            else f"group size {traits.group_size}"
        fallback = f"gptq: gptq_gemm (ExLlama), float16 only; no Marlin for {why} GPTQ"
        return {engine: fallback for engine in ENGINES}
    order = ", act-order" if traits.act_order else ""
    if traits.group_size in MACHETE_GROUP_SIZES:
        vllm = f"gptq_marlin: Machete on Hopper, Marlin elsewhere{order}"
    else:
        vllm = f"gptq_marlin: Marlin{order}"
    return {"vLLM": vllm, "SGLang": f"gptq_marlin: Marlin{order}"}


def describe(traits: CheckpointTraits) -> list[str]:
    """One line per engine, for people: ``vLLM    gptq_marlin: ...``."""
    return [f"{engine:<7} {kernel}" for engine, kernel in engine_kernels(traits).items()]
