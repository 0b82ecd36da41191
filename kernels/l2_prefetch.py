"""Ask the GPU's L2 cache for a tensor's first bytes ahead of the kernel that will read them.

Why: in a decode step at batch 1 every linear streams its weights from memory once, and between the linears run
kernels that barely touch memory (decode attention, norms, the activation) while each GEMV ramps up and drains
its last wave: the memory bus idles for microseconds a kernel boundary, the more so the smaller the layers (an
FP8 o_proj of Llama-3-8B is 16.8 MB, ~4 us of the bus). The weights depend on nothing the step computes, so
they can be requested early: this kernel, launched in the stream right after the kernel before the idle stretch,
issues ``prefetch.global.L2`` for ``max_bytes`` of the next linear's weight (no data comes back to the SM;
nothing waits for it), and the GEMV then finds those lines in L2 or already on their way.

Programmatic dependent launch (Hopper): the kernel lets the next one launch at once, issues its prefetches
while the kernel before it is still running, then waits for that kernel to finish before it exits, so the
kernel after it still starts after the one before (a kernel's wait covers the grid just before it only).

There is nothing to emulate off the GPU: under Triton's interpreter or on the CPU :func:`l2_prefetch` launches
nothing (a prefetch changes no value anywhere). Reference: none needed for values; the GPU test checks that a
step's logits are bitwise the same with and without it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantkit.kernels.device_info import interpreting, pdl_launch, programmatic_launch

LINE_BYTES = 128  # what one prefetch.global.L2 requests: the L2 line holding the address
LINES_PER_PROGRAM = 1024  # 128 KB a program: 8 prefetches a thread at 4 warps; 16 MB is 128 programs


@triton.jit
def _prefetch_lines(addresses, valid):
    """``prefetch.global.L2`` of each address where ``valid`` (a hint: no register waits for it)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [addresses.to(tl.int64), valid.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(base_ptr, n_lines, LINES: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr):
    """Program p requests lines ``[p * LINES, (p + 1) * LINES)`` of LINE bytes at ``base_ptr`` (a byte pointer)
    below ``n_lines``. PDL: the next kernel may launch at once; the wait comes after the requests (they read nothing
    the previous kernel writes) and keeps this grid from finishing before that kernel has."""
    if PDL:
        gdc_launch_dependents()
    lines = tl.program_id(0).to(tl.int64) * LINES + tl.arange(0, LINES)
    _prefetch_lines(base_ptr + lines * LINE, lines < n_lines)
    if PDL:
        gdc_wait()


def prefetch_bytes(t: torch.Tensor, max_bytes: int) -> int:
    """How many of ``t``'s first bytes :func:`l2_prefetch` requests: all of them up to ``max_bytes``."""
    return min(t.numel() * t.element_size(), max(0, max_bytes))


def l2_prefetch(t: torch.Tensor, max_bytes: int) -> int:
    """Request the first ``max_bytes`` of contiguous ``t`` (all of it if smaller) into L2, in the current stream
    (CUDA-graph safe). Returns the number of programs launched: 0 off CUDA, under the interpreter, or for nothing
    to request. Raises ValueError for a tensor that is not contiguous (its first bytes would not be its first
    elements)."""
    if not t.is_contiguous():
        raise ValueError(f"l2_prefetch takes a contiguous tensor, got strides {t.stride()} for shape {tuple(t.shape)}")
    n_bytes = prefetch_bytes(t, max_bytes)
    if t.device.type != "cuda" or interpreting() or n_bytes == 0:
        return 0
    n_lines = triton.cdiv(n_bytes, LINE_BYTES)
    programs = triton.cdiv(n_lines, LINES_PER_PROGRAM)
    pdl = programmatic_launch(t.device)
    _l2_prefetch_kernel[(programs,)](t.view(-1).view(torch.uint8), n_lines, LINES=LINES_PER_PROGRAM,
                                     LINE=LINE_BYTES, PDL=pdl,
                                     num_warps=4, num_stages=1, **pdl_launch(pdl))
    return programs
