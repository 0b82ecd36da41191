"""The CUDA C++ W4A16 decode GEMM (``w4a16_cuda.cu``, M <= 16): build on first use, launch, fall back.

The kernel (design in the .cu file's header) is compiled by nvcc into one small shared library per config, dtype
and zero-point mode (no torch headers, no ninja: ~10 s a build), cached per machine under
``$QUANTKIT_CUDA_CACHE`` (default ``~/.cache/quantkit/cuda``) by a hash of the source, the flags, nvcc's version
and the GPU architecture, and launched through ctypes on torch's current stream (CUDA graphs capture it).

Nothing here fails a user's command for want of a compiler: :func:`library` returns None, with one log line, where
nvcc is missing or a build fails, and :func:`available` says why; the selection then keeps the Triton kernels
(``w4a16.bind_launcher``). The plain-PyTorch reference is ``w4a16_weights.w4a16_matmul_ref``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from quantkit.kernels.device_info import ab_switch, capability, num_sms, programmatic_launch
from quantkit.kernels.w4a16_configs import CUDA_MAX_M, PAIR_TILE_K, CudaConfig
from quantkit.kernels.w4a16_weights import W4A16Weights

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("w4a16_cuda.cu")
# Compiled by bench/sass_w4a16_decode.py for sm_90a and read there (bytes in flight, load widths)
SASS_CONFIGS = (CudaConfig(2, 2, 4), CudaConfig(4, 1, 4), CudaConfig(1, 4, 4), CudaConfig(2, 2, 8))
_NVCC_FLAGS = ("-O3", "-std=c++17", "--use_fast_math", "-lineinfo")

__all__ = ["CudaConfig", "available", "library", "w4a16_cuda_matmul"]


def nvcc_path() -> str | None:
    """nvcc on PATH, else under ``$CUDA_HOME``/``$CUDA_PATH`` or /usr/local/cuda; None where there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def _arch_flags(cap: tuple[int, int]) -> list[str]:
    major, minor = cap
    suffix = "a" if (major, minor) == (9, 0) else ""  # sm_90a: the Hopper-specific target
    return [f"-gencode=arch=compute_{major}{minor}{suffix},code=sm_{major}{minor}{suffix}"]


def _defines(cfg: CudaConfig, mt: int, bf16: bool, zeros: bool, pdl: bool = False) -> list[str]:
    return [f"-DQK_R={cfg.R}", f"-DQK_U={cfg.U}", f"-DQK_W={cfg.W}", f"-DQK_MT={mt}", f"-DQK_BF16={int(bf16)}",
            f"-DQK_ZEROS={int(zeros)}", f"-DQK_L2_256={int(cfg.L2_256)}", f"-DQK_PDL={int(pdl)}"]


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]


def cache_dir() -> Path:
    return Path(os.environ.get("QUANTKIT_CUDA_CACHE", Path.home() / ".cache" / "quantkit" / "cuda"))


def _build(nvcc: str, args: list[str], out: Path, source: Path = SOURCE, timeout: float = 600) -> str | None:
    """Run nvcc on ``source`` into ``out`` (written whole, then renamed: concurrent builds do not see half a file);
    None on success, else nvcc's output."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=out.suffix)
    os.close(fd)
    try:
        done = subprocess.run([nvcc, *args, "-o", tmp, str(source)], capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            return (done.stdout + done.stderr)[-3000:]
        os.replace(tmp, out)
        return None
    except (OSError, subprocess.TimeoutExpired) as e:
        return repr(e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def built_library(nvcc: str, source: Path, args: list[str], prefix: str, what: str, timeout: float = 600):
    """``source`` compiled by nvcc with ``args`` into a shared library, loaded: from the per-machine cache (keyed by
    the source, the arguments and nvcc's version) or built now; None, with one log line saying why, where the build
    or the load fails (``what`` names the kernel in it)."""
    key = hashlib.sha256("\n".join([source.read_text(), " ".join(args), _nvcc_version(nvcc)]).encode()).hexdigest()
    path = cache_dir() / f"{prefix}_{key[:24]}.so"
    if not path.exists():
        log.info("building %s with nvcc (once per machine)", what)
        err = _build(nvcc, args, path, source, timeout)
        if err is not None:
            log.warning("%s: nvcc failed; the Triton kernels serve:\n%s", what, err)
            return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("%s: cannot load %s (%s); the Triton kernels serve", what, path, e)
        return None


@functools.cache
def library(cfg: CudaConfig, mt: int, bf16: bool, zeros: bool, cap: tuple[int, int], pdl: bool = False):
    """The compiled shared library of one variant for compute capability ``cap`` (``pdl``: the build that waits
    for the previous grid, for launches with programmatic dependent launch), built on first use; None (and one
    log line) where nvcc is missing or the build or load fails."""
    nvcc = nvcc_path()
    if nvcc is None:
        log.warning("W4A16 CUDA decode kernel: no nvcc on this machine; the Triton kernels serve")
        return None
    args = [*_NVCC_FLAGS, *_arch_flags(cap), *_defines(cfg, mt, bf16, zeros, pdl), "-shared", "-Xcompiler", "-fPIC"]
    lib = built_library(nvcc, SOURCE, args, "w4a16_cuda", f"W4A16 CUDA decode kernel {cfg}")
    if lib is None:
        return None
    lib.qk_w4a16_decode_launch.restype = ctypes.c_int
    lib.qk_w4a16_decode_launch.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 10 + [ctypes.c_void_p]
    lib.qk_w4a16_decode_occupancy.restype = ctypes.c_int
    return lib


def compile_cubin(out: Path, cfg: CudaConfig, mt: int = 1, bf16: bool = True, zeros: bool = False,
                  pdl: bool = False) -> str | None:
    """nvcc's output for an sm_90a cubin of one variant at ``out`` (for reading its SASS); None without nvcc.
    Raises where the compile fails."""
    nvcc = nvcc_path()
    if nvcc is None:
        return None
    args = [*_NVCC_FLAGS, *_arch_flags((9, 0)), *_defines(cfg, mt, bf16, zeros, pdl), "-cubin", "-Xptxas", "-v"]
    done = subprocess.run([nvcc, *args, "-o", str(out), str(SOURCE)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvcc failed:\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


def cuda_pdl(device: torch.device) -> bool:
    """Whether the kernel launches with programmatic dependent launch (its wait and trigger are in the .cu file):
    where :func:`~quantkit.kernels.device_info.programmatic_launch` allows it, unless ``QUANTKIT_W4A16_CUDA_PDL=0``
    (the A/B switch). Measured on one H100 (2026-12-06, docs/kernels.md): the Qwen3-30B-A3B step with the CUDA
    kernel on q/k/v ran 2.453 ms a batch-1 step with PDL against 2.501 with the plain launch (the Gluon pick: 2.495),
    the Llama-3-8B step with it on gate/up 2.696 against 2.690 (a tie)."""
    return ab_switch("QUANTKIT_W4A16_CUDA_PDL", ("1", "0")) == "1" and programmatic_launch(device)


def supports(x: torch.Tensor, w: W4A16Weights) -> tuple[bool, str]:
    """Whether the kernel can take the call at all (before any build)."""
    if not x.is_cuda:
        return False, "input is not on a CUDA device"
    if capability(x.device) < (8, 0):
        return False, "needs an sm_80 or newer GPU"
    if x.dtype not in (torch.float16, torch.bfloat16):
        return False, f"activations are {x.dtype}, the kernel takes float16/bfloat16"
    if w.bits != 4 or w.in_features % PAIR_TILE_K or w.group_size is None or w.group_size % PAIR_TILE_K:
        return False, f"needs 4-bit codes, K and groups multiples of {PAIR_TILE_K}"
    if not 1 <= x.shape[0] <= CUDA_MAX_M:
        return False, f"takes 1 to {CUDA_MAX_M} activation rows, got {x.shape[0]}"
    return True, ""


def available(x: torch.Tensor, w: W4A16Weights, cfg: CudaConfig) -> tuple[bool, str]:
    """Whether ``cfg`` can serve the call here: supported, and its library built (building it now if needed)."""
    ok, reason = supports(x, w)
    if not ok:
        return ok, reason
    if _library_for(x, w, cfg, cuda_pdl(x.device)) is None:
        return False, _NOT_BUILT
    return True, ""


_NOT_BUILT = "the CUDA kernel is not built here (no nvcc, or the build failed: see the log)"


def _library_for(x: torch.Tensor, w: W4A16Weights, cfg: CudaConfig, pdl: bool):
    mt = 1 if x.shape[0] <= 8 else 2
    return library(cfg, mt, x.dtype == torch.bfloat16, w.zeros is not None, capability(x.device), pdl)


def splits_for(cfg: CudaConfig, n: int, k_tiles: int, resident_ctas: int) -> int:
    """CTAs per row tile: ``cfg.SPLITS``, else the fewest that fill every SM's resident CTAs once, and never so
    many that a warp gets less than one load batch."""
    row_tiles = -(-n // (16 * cfg.R))
    most = max(1, k_tiles // (cfg.W * cfg.U))
    want = cfg.SPLITS if cfg.SPLITS is not None else -(-resident_ctas // row_tiles)
    return max(1, min(want, most))


def w4a16_cuda_matmul(x: torch.Tensor, w: W4A16Weights, cfg: CudaConfig) -> torch.Tensor:
    """``x [M, K] @ W^T`` through the CUDA kernel ``cfg``; raises (never falls back) where it cannot run: callers
    that want the fallback check :func:`available` once first."""
    ok, reason = supports(x, w)
    pdl = cuda_pdl(x.device)  # read once: the library built for it and the launch must agree
    lib = _library_for(x, w, cfg, pdl) if ok else None
    if lib is None:
        raise ValueError(f"the CUDA W4A16 kernel cannot run this call: {reason or _NOT_BUILT}")
    if w.perm is not None:
        x = x[:, w.perm]
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    n = w.out_features
    k_tiles = k // PAIR_TILE_K
    occupancy = _occupancy(lib)
    splits = splits_for(cfg, n, k_tiles, occupancy * num_sms(x.device))
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    ws, counters = out, out  # unused without a split
    if splits > 1:
        row_tiles = -(-n // (16 * cfg.R))
        if w.partial_sums is not None and w.partial_sums.numel() >= m * n and w.tile_counters.numel() >= row_tiles:
            ws, counters = w.partial_sums, w.tile_counters  # the layer's, left zeroed by every call
        else:
            ws = torch.zeros(m * n, device=x.device, dtype=torch.float32)
            counters = torch.zeros(row_tiles, device=x.device, dtype=torch.int32)
    zeros = w.zeros if w.zeros is not None else w.scales  # dummy pointer when symmetric
    group_tiles = w.group_size // PAIR_TILE_K
    err = lib.qk_w4a16_decode_launch(
        w.qweight.data_ptr(), x.data_ptr(), w.scales.data_ptr(), zeros.data_ptr(), out.data_ptr(), ws.data_ptr(),
        counters.data_ptr(), m, n, k_tiles, splits, w.qweight.stride(0), x.stride(0), w.scales.stride(0),
        zeros.stride(0), group_tiles, int(pdl),
        ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream))
    if err:
        raise RuntimeError(f"the CUDA W4A16 kernel failed to launch (cudaError {err})")
    return out


@functools.cache
def _occupancy_cached(lib) -> int:
    return max(1, lib.qk_w4a16_decode_occupancy())


def _occupancy(lib) -> int:
    return _occupancy_cached(lib)
