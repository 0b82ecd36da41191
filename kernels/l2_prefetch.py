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
MAX_RANGES = 4  # byte ranges one launch requests


@triton.jit
def _prefetch_lines(addresses, valid):
    """``prefetch.global.L2`` of each address where ``valid`` (a hint: no register waits for it)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [addresses, valid.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(a0, a1, a2, a3, n0, n1, n2, n3, end0, end1, end2, LINES: tl.constexpr, LINE: tl.constexpr,
                        PDL: tl.constexpr):
    """Up to four byte ranges, range r at address ``a_r`` (an integer) with ``n_r`` lines of LINE bytes: programs
    ``[end_{r-1}, end_r)`` request it, LINES lines each (the last range's programs run to the grid's end). PDL:
    the next kernel may launch at once; the wait comes after the requests (they read nothing the previous kernel
    writes) and keeps this grid from finishing before that kernel has."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    address = a0.to(tl.int64)
    n_lines = n0
    first = pid * 0
    if pid >= end0:
        address = a1.to(tl.int64)
        n_lines = n1
        first = end0
    if pid >= end1:
        address = a2.to(tl.int64)
        n_lines = n2
        first = end1
    if pid >= end2:
        address = a3.to(tl.int64)
        n_lines = n3
        first = end2
    lines = (pid - first).to(tl.int64) * LINES + tl.arange(0, LINES)
    _prefetch_lines(address + lines * LINE, lines < n_lines)
    if PDL:
        gdc_wait()


def prefetch_bytes(t: torch.Tensor, max_bytes: int) -> int:
    """How many of ``t``'s first bytes :func:`l2_prefetch` requests: all of them up to ``max_bytes``."""
    return min(t.numel() * t.element_size(), max(0, max_bytes))


def l2_prefetch(ranges: list[tuple[torch.Tensor, int]]) -> int:
    """Request the first ``max_bytes`` of each contiguous tensor in ``ranges`` (``(tensor, max_bytes)``, all of
    a tensor if smaller; at most :data:`MAX_RANGES`, on one device) into L2, in one launch in the current stream
    (CUDA-graph safe). Returns the number of programs launched: 0 off CUDA, under the interpreter, or for nothing
    to request. Raises ValueError for a tensor that is not contiguous (its first bytes would not be its first
    elements), for more than MAX_RANGES ranges or for ranges on several devices."""
    if len(ranges) > MAX_RANGES:
        raise ValueError(f"l2_prefetch takes at most {MAX_RANGES} ranges a launch, got {len(ranges)}")
    for t, _ in ranges:
        if not t.is_contiguous():
            raise ValueError(f"l2_prefetch takes contiguous tensors, got strides {t.stride()} for shape "
                             f"{tuple(t.shape)}")
    if len({t.device for t, _ in ranges}) > 1:
        raise ValueError("l2_prefetch: the ranges of one launch must be on one device")
    todo = [(t.data_ptr(), triton.cdiv(prefetch_bytes(t, cap), LINE_BYTES)) for t, cap in ranges]
    todo = [(address, lines) for address, lines in todo if lines]
    if not todo or ranges[0][0].device.type != "cuda" or interpreting():
        return 0
    ends, total = [], 0
    for _, lines in todo:
        total += triton.cdiv(lines, LINES_PER_PROGRAM)
        ends.append(total)
    todo += [(todo[0][0], 0)] * (MAX_RANGES - len(todo))  # unused ranges: no lines, no programs
    ends += [total] * (MAX_RANGES - len(ends))
    pdl = programmatic_launch(ranges[0][0].device)
    _l2_prefetch_kernel[(total,)](*(a for a, _ in todo), *(n for _, n in todo), *ends[:3], LINES=LINES_PER_PROGRAM,
                                  LINE=LINE_BYTES, PDL=pdl, num_warps=4, num_stages=1, **pdl_launch(pdl))
    return total
