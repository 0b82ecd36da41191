"""A decode token's FP8 MLP in one launch: ``down(act(gate) * up)`` on e4m3 weights, the input already quantized
(the norm kernel in front writes its codes), for one activation row.

Why: at batch 1 the MLP is three kernels (the gate/up GEMV, the activation with the row's quantization, the down
GEMV), and each of the two GEMVs, already reading its bytes at the rate of a device copy of them, pays the ramp
and the tail every kernel pays between the weight stream stopping and starting again (docs/fp8.md: the 8B step's
129 GEMVs, ~2-3 us each). Here the weight stream runs on across the activation: a persistent grid (every program
resident, at most ``ctas_per_sm`` a multiprocessor, launched cooperatively so the driver refuses a grid that could
not be) computes the gate/up rows in pairs, so each program applies the activation to the rows it owns and writes
``h`` (16-bit, as the unfused path rounds it) and its running absmax; the programs meet once at a grid barrier,
having already requested their first down tile, then compute the down rows from ``h`` quantized in registers with
the row's one scale, exactly as ``fp8_quant.quantize_per_token`` rounds it.

The barrier: an arrival counter and a generation word (``state[0]``, ``state[1]``, int32, zero at the start) and
two absmax slots (``amax[2]``, float32 bits as int32, zero) alternating by generation, so the state left by one
call is the start of the next and CUDA-graph replays need no reset: the last program to arrive zeroes the counter
and the other slot, then bumps the generation, which the others spin on. Under the interpreter the grid is one
program.

Reference: :func:`fp8_mlp_ref` (float32, the same roundings). Which calls take this kernel, and what measured it:
``quantkit.runtime.model`` (``QUANTKIT_FP8_MLP``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quantkit.kernels.decoder_ops import gated_act
from quantkit.kernels.device_info import gpu_card, interpreting, pdl_launch, programmatic_launch
from quantkit.kernels.fp8_quant import e4m3_codes, e4m3_scale
from quantkit.kernels.gemv import _weight_tile, require_powers_of_two

# Codes a thread loads at once in each phase: 16 e4m3 input codes and weights (16 bytes) in the first; in the
# second 8, as ``h`` is 16-bit there (8 values, 16 bytes) and its codes are made in registers. A K tile spans one
# run a thread, 32 threads, then the warps, so the input's slice already lies as the tile's columns do (no
# shared-memory exchange) and each thread sums its run in registers.
VEC1, VEC2 = 16, 8


@dataclass(frozen=True)
class FP8MlpConfig:
    """``pairs``: gate/up row pairs a unit of the first phase; ``rows``: down rows a unit of the second; the K
    tiles follow from ``num_warps`` (:attr:`block_k1`, :attr:`block_k2`); ``ctas_per_sm``: resident programs a
    multiprocessor (the grid is that many times the SM count, cut to what the compiled kernel's resources let an SM
    hold); ``preload``: request the first down tile before the barrier; ``cooperative``: launch so that the driver
    refuses a grid it cannot hold at once, rather than leaving the barrier waiting on programs that never start
    (off: the A/B of what the cooperative launch costs)."""

    pairs: int = 2
    rows: int = 4
    num_warps: int = 4
    ctas_per_sm: int = 8
    preload: bool = True
    cooperative: bool = True

    def __post_init__(self):
        require_powers_of_two(self, ("pairs", "rows", "num_warps"))
        if self.ctas_per_sm < 1:
            raise ValueError(f"FP8MlpConfig.ctas_per_sm must be >= 1, got {self.ctas_per_sm}")

    @property
    def block_k1(self) -> int:
        return VEC1 * 32 * self.num_warps

    @property
    def block_k2(self) -> int:
        return VEC2 * 32 * self.num_warps


DEFAULT_CONFIG = FP8MlpConfig()
# Configs by (card, K, I) measured on that card by `python bench/bench_fp8_mlp.py`; others take DEFAULT_CONFIG.
TUNED_FP8_MLP: dict[tuple[str, int, int], FP8MlpConfig] = {}


def fp8_mlp_config(card: str | None, k: int, inter: int) -> FP8MlpConfig:
    """The launch config for hidden size ``k`` and intermediate size ``inter`` on ``card``."""
    return TUNED_FP8_MLP.get((card, k, inter), DEFAULT_CONFIG)


@triton.jit
def _codes_tile(w_ptr, rows, n_rows, stride, k0, ks, K, EVEN_K: tl.constexpr):
    """The ``[len(rows), BLOCK_K]`` e4m3 tile at column ``k0`` as stored (rows past ``n_rows`` read the last one,
    zeros past K; ``gemv._weight_tile``): held in its 1-byte codes until it is multiplied, so a tile in flight
    costs a quarter of the registers its float32 products do."""
    return _weight_tile(w_ptr + tl.minimum(rows, n_rows - 1).to(tl.int64)[:, None] * stride, k0, ks, K, EVEN_K)


@triton.jit
def _input_codes(x_ptr, k0, ks, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptr + k0 + ks).to(tl.float32)
    return tl.load(x_ptr + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)


@triton.jit
def _h_codes(h_ptr, k0, ks, INTER, scale, EVEN_K: tl.constexpr):
    """``h[k0 + ks]`` rounded to e4m3 codes with ``scale``, as float32; read from L2 (``.cg``): other programs
    wrote ``h`` in this launch."""
    if EVEN_K:
        h = tl.load(h_ptr + k0 + ks, cache_modifier=".cg")
    else:
        h = tl.load(h_ptr + k0 + ks, mask=k0 + ks < INTER, other=0.0, cache_modifier=".cg")
    return e4m3_codes(h.to(tl.float32), scale).to(tl.float32)


@triton.jit
def _partial_dot(w, x, VEC: tl.constexpr):
    """``w [R, BK]`` (codes) times ``x [BK]`` (float32), summed over each run of VEC columns: ``[R, BK // VEC]``.
    A thread holds VEC contiguous columns, so the sum stays in its registers, and the accumulator a thread
    carries is VEC times smaller than the tile it loads, leaving registers for more tiles in flight."""
    p = w.to(tl.float32) * x[None, :]
    return tl.sum(tl.reshape(p, [p.shape[0], p.shape[1] // VEC, VEC]), axis=2)


@triton.jit
def _gate_up_pairs(wg, wu, x_ptr, xs, w_ptr, s_ptr, h_ptr, rows, amax, INTER, K, stride_w, ks,
                   GELU: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """A unit of the first phase: ``h`` of gate rows ``rows`` and up rows ``INTER + rows`` (their first K tiles
    ``wg``, ``wu`` given) stored, and the running absmax ``amax`` of ``h`` returned. The GEMV's 16-bit output, the
    activation in float32 and its 16-bit result, as the unfused kernels round them."""
    x = _input_codes(x_ptr, 0, ks, K, EVEN_K)
    acc_g = _partial_dot(wg, x, VEC)
    acc_u = _partial_dot(wu, x, VEC)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x = _input_codes(x_ptr, k0, ks, K, EVEN_K)
        acc_g += _partial_dot(_codes_tile(w_ptr, rows, INTER, stride_w, k0, ks, K, EVEN_K), x, VEC)
        acc_u += _partial_dot(_codes_tile(w_ptr, rows + INTER, 2 * INTER, stride_w, k0, ks, K, EVEN_K), x, VEC)
    ok = rows < INTER
    g = (tl.sum(acc_g, axis=1) * xs * tl.load(s_ptr + rows, mask=ok, other=0.0)).to(tl.bfloat16).to(tl.float32)
    up = (tl.sum(acc_u, axis=1) * xs * tl.load(s_ptr + INTER + rows, mask=ok, other=0.0))
    h = (gated_act(g, GELU) * up.to(tl.bfloat16).to(tl.float32)).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + rows, h, mask=ok)
    return tl.maximum(amax, tl.max(tl.where(ok, tl.abs(h.to(tl.float32)), 0.0), axis=0))


@triton.jit
def _down_rows(w, h_ptr, scale, w_ptr, s_ptr, y_ptr, rows, H, INTER, stride_w, ks, EVEN_K: tl.constexpr,
               BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """A unit of the second phase: ``y[rows]``, the down rows' products with ``h`` in codes (``w``: their first K
    tile), scaled and stored."""
    acc = _partial_dot(w, _h_codes(h_ptr, 0, ks, INTER, scale, EVEN_K), VEC)
    for k0 in range(BLOCK_K, INTER, BLOCK_K):
        h = _h_codes(h_ptr, k0, ks, INTER, scale, EVEN_K)
        acc += _partial_dot(_codes_tile(w_ptr, rows, H, stride_w, k0, ks, INTER, EVEN_K), h, VEC)
    ok = rows < H
    y = tl.sum(acc, axis=1) * scale * tl.load(s_ptr + rows, mask=ok, other=0.0)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=ok)


# GRID is not specialized on: the launcher compiles once with a trial grid to read the kernel's registers, and
# the grid it then launches must run that same binary
@triton.jit(do_not_specialize=["GRID"])
def _fp8_mlp_kernel(x_ptr, xs_ptr, wgu_ptr, sgu_ptr, wd_ptr, sd_ptr, h_ptr, amax_ptr, state_ptr, y_ptr,
                    INTER, K, H, stride_gu, stride_d, GRID,
                    GELU: tl.constexpr, PAIRS: tl.constexpr, BLOCK_K1: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_K2: tl.constexpr, EVEN_K1: tl.constexpr, EVEN_K2: tl.constexpr, PRELOAD: tl.constexpr,
                    PDL: tl.constexpr, VEC1: tl.constexpr, VEC2: tl.constexpr):
    pid = tl.program_id(0)
    ks1 = tl.arange(0, BLOCK_K1)
    ks2 = tl.max_contiguous(tl.arange(0, BLOCK_K2), VEC2)  # 8 codes a load, as 8 values of h
    n_units1 = tl.cdiv(INTER, PAIRS)
    n_units2 = tl.cdiv(H, ROWS)
    # the first unit's first weight tiles are constants: requested before waiting for the kernel that writes x.
    # Each phase's first unit is peeled off its loop, so no tile is carried across the loop's iterations
    rows = pid * PAIRS + tl.arange(0, PAIRS)
    wg = _codes_tile(wgu_ptr, rows, INTER, stride_gu, 0, ks1, K, EVEN_K1)
    wu = _codes_tile(wgu_ptr, rows + INTER, 2 * INTER, stride_gu, 0, ks1, K, EVEN_K1)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    gen = tl.atomic_add(state_ptr + 1, 0)  # after the wait: every earlier call of this kernel has finished
    slot = gen % 2
    xs = tl.load(xs_ptr)
    amax = 0.0
    if pid < n_units1:
        amax = _gate_up_pairs(wg, wu, x_ptr, xs, wgu_ptr, sgu_ptr, h_ptr, rows, amax, INTER, K, stride_gu, ks1,
                              GELU, EVEN_K1, BLOCK_K1, VEC1)
    for u in range(pid + GRID, n_units1, GRID):
        rows = u * PAIRS + tl.arange(0, PAIRS)
        wg = _codes_tile(wgu_ptr, rows, INTER, stride_gu, 0, ks1, K, EVEN_K1)
        wu = _codes_tile(wgu_ptr, rows + INTER, 2 * INTER, stride_gu, 0, ks1, K, EVEN_K1)
        amax = _gate_up_pairs(wg, wu, x_ptr, xs, wgu_ptr, sgu_ptr, h_ptr, rows, amax, INTER, K, stride_gu, ks1,
                              GELU, EVEN_K1, BLOCK_K1, VEC1)
    rows = pid * ROWS + tl.arange(0, ROWS)
    if PRELOAD:  # the first down tile is in flight while the grid waits at the barrier
        wd = _codes_tile(wd_ptr, rows, H, stride_d, 0, ks2, INTER, EVEN_K2)
    # non-negative float32 order as their int32 bits: an integer atomic max (the interpreter has no float one)
    tl.atomic_max(amax_ptr + slot, amax.to(tl.int32, bitcast=True))
    tl.debug_barrier()  # every thread's h stores before this program's release below
    arrived = tl.atomic_add(state_ptr, 1)
    if arrived == GRID - 1:  # the last one: reset for the next call, then release the others
        tl.atomic_xchg(state_ptr, 0)
        tl.atomic_xchg(amax_ptr + 1 - slot, 0)
        tl.atomic_add(state_ptr + 1, 1)
    else:
        while tl.atomic_add(state_ptr + 1, 0) == gen:
            pass
    tl.debug_barrier()
    scale = e4m3_scale(tl.atomic_max(amax_ptr + slot, 0).to(tl.float32, bitcast=True))
    if not PRELOAD:
        wd = _codes_tile(wd_ptr, rows, H, stride_d, 0, ks2, INTER, EVEN_K2)
    if pid < n_units2:
        _down_rows(wd, h_ptr, scale, wd_ptr, sd_ptr, y_ptr, rows, H, INTER, stride_d, ks2, EVEN_K2, BLOCK_K2, VEC2)
    for u in range(pid + GRID, n_units2, GRID):
        rows = u * ROWS + tl.arange(0, ROWS)
        wd = _codes_tile(wd_ptr, rows, H, stride_d, 0, ks2, INTER, EVEN_K2)
        _down_rows(wd, h_ptr, scale, wd_ptr, sd_ptr, y_ptr, rows, H, INTER, stride_d, ks2, EVEN_K2, BLOCK_K2, VEC2)


@dataclass
class FP8MlpState:
    """One MLP's scratch between its two phases: ``h`` (16-bit ``[I]``), the absmax slots (float32 bits as
    int32) and the barrier words.
    Kept with the layer: a graph replays the same buffers, and the state one call leaves is the next one's start."""

    h: torch.Tensor
    amax: torch.Tensor
    barrier: torch.Tensor
    grids: dict = field(default_factory=dict)  # FP8MlpConfig -> the grid that stays resident, found at first use

    @classmethod
    def create(cls, intermediate: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> FP8MlpState:
        return cls(torch.empty(intermediate, device=device, dtype=dtype),
                   torch.zeros(2, device=device, dtype=torch.int32),
                   torch.zeros(2, device=device, dtype=torch.int32))


def fp8_mlp_problem(qx: torch.Tensor, sx: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    activation: str) -> str:
    """Why :func:`fp8_mlp` cannot take these operands, or ""."""
    if qx.dim() != 2 or qx.shape[0] != 1:
        return f"one activation row, got {tuple(qx.shape)}"
    if qx.dtype != torch.float8_e4m3fn or w_gate_up.dtype != qx.dtype or w_down.dtype != qx.dtype:
        return "input codes and both weights must be float8_e4m3fn"
    k = qx.shape[1]
    if w_gate_up.dim() != 2 or w_gate_up.shape[1] != k or w_gate_up.shape[0] % 2:
        return f"gate/up must be [2 * intermediate, {k}], got {tuple(w_gate_up.shape)}"
    inter = w_gate_up.shape[0] // 2
    if w_down.dim() != 2 or w_down.shape[1] != inter:
        return f"down must be [H, {inter}], got {tuple(w_down.shape)}"
    if sx.numel() != 1 or sx.dtype != torch.float32:
        return "the input's scale must be one float32"
    if activation not in ("silu", "gelu_tanh"):
        return f"activation {activation!r} is not silu or gelu_tanh"
    if any(t.stride(-1) != 1 for t in (qx, w_gate_up, w_down)):
        return "input and weights must be contiguous along K"
    if qx.device.type != "cuda" and not interpreting():
        return "the fused MLP runs on CUDA (or under TRITON_INTERPRET=1)"
    return ""


def fp8_mlp(qx: torch.Tensor, sx: torch.Tensor, w_gate_up: torch.Tensor, s_gate_up: torch.Tensor,
            w_down: torch.Tensor, s_down: torch.Tensor, state: FP8MlpState, activation: str = "silu",
            config: FP8MlpConfig | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``down(act(gate) * up)`` -> ``[1, H]`` in ``out_dtype`` for input codes ``qx [1, K]`` with scale ``sx``:
    gate/up e4m3 ``[2 I, K]`` (gate rows first) with per-row scales ``s_gate_up [2 I]``, down e4m3 ``[H, I]`` with
    ``s_down [H]``; what ``gemv`` on codes, ``act_mul_fp8`` and ``gemv`` again give, up to float32 summation order.
    ``config`` None: the card's tuned one (:func:`fp8_mlp_config`). Raises ValueError where
    :func:`fp8_mlp_problem` says no."""
    reason = fp8_mlp_problem(qx, sx, w_gate_up, w_down, activation)
    if reason:
        raise ValueError(reason)
    k = qx.shape[1]
    inter = w_gate_up.shape[0] // 2
    hidden = w_down.shape[0]
    y = torch.empty((1, hidden), device=qx.device, dtype=out_dtype)
    config = config or fp8_mlp_config(gpu_card(qx.device), k, inter)
    pdl = programmatic_launch(qx.device)
    args = [qx, sx, w_gate_up, s_gate_up.reshape(-1), w_down, s_down.reshape(-1), state.h, state.amax, state.barrier,
            y, inter, k, hidden, w_gate_up.stride(0), w_down.stride(0)]
    meta = dict(GELU=activation == "gelu_tanh", PAIRS=config.pairs, BLOCK_K1=config.block_k1, ROWS=config.rows,
                BLOCK_K2=config.block_k2, EVEN_K1=k % config.block_k1 == 0, EVEN_K2=inter % config.block_k2 == 0,
                PRELOAD=config.preload, PDL=pdl, VEC1=VEC1, VEC2=VEC2, num_warps=config.num_warps, num_stages=1,
                **pdl_launch(pdl))
    if interpreting():
        _fp8_mlp_kernel[(1,)](*args, 1, **meta)
        return y
    meta["launch_cooperative_grid"] = config.cooperative
    grid = state.grids.get(config)
    if grid is None:  # the compiled kernel's registers and shared memory say how many programs an SM holds
        compiled = _fp8_mlp_kernel.warmup(*args, 2, grid=(1,), **meta)
        sms = torch.cuda.get_device_properties(qx.device).multi_processor_count
        grid = state.grids[config] = sms * min(config.ctas_per_sm, _resident_per_sm(compiled, config.num_warps))
    _fp8_mlp_kernel[(grid,)](*args, grid, **meta)
    return y


def _resident_per_sm(compiled, num_warps: int) -> int:
    """Programs of a compiled Triton kernel one Hopper SM holds at once: 64 K registers (allocated per warp in
    units of 256), 2,048 threads, 227 KB of shared memory, 32 blocks."""
    compiled._init_handles()  # loads the binary, which is when Triton reads its register count
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * num_warps)
    by_threads = 2048 // (32 * num_warps)
    shared = compiled.metadata.shared
    by_shared = 227 * 1024 // shared if shared else 32
    return max(1, min(by_regs, by_threads, by_shared, 32))


def fp8_mlp_ref(qx: torch.Tensor, sx: torch.Tensor, w_gate_up: torch.Tensor, s_gate_up: torch.Tensor,
                w_down: torch.Tensor, s_down: torch.Tensor, activation: str = "silu",
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The plain-PyTorch reference of :func:`fp8_mlp` (float32 products and sums, the same 16-bit roundings of
    gate/up and ``h``, ``h`` quantized per token as ``quantize_per_token``)."""
    from quantkit.kernels.decoder_ops_ref import act_mul_ref
    from quantkit.kernels.fp8_quant_ref import quantize_per_token_ref

    x = qx.float() * sx.float().reshape(-1, 1)
    gate_up = (x @ w_gate_up.float().t()) * s_gate_up.float().reshape(1, -1)
    h = act_mul_ref(gate_up.to(torch.bfloat16), activation)
    qh, sh = quantize_per_token_ref(h)
    y = (qh.float() @ w_down.float().t()) * sh * s_down.float().reshape(1, -1)
    return y.to(out_dtype)
