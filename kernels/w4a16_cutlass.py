"""The CUTLASS W4A16 prefill GEMM on Hopper (``w4a16_cutlass.cu``): build on first use, prepare, launch.

The kernel is CUTLASS's mixed-input GEMM (the ``nvidia-cutlass`` package's headers, ``pip install
'quantkit[cutlass]'``) instantiated in ``w4a16_cutlass.cu`` (why, and the operand layouts, in its header),
compiled by nvcc into one shared library per config (~1 minute on one core: CUTLASS's templates), cached per
machine beside the CUDA decode kernel's (``w4a16_cuda.cache_dir``) by a hash of the source, the flags (the
headers' folder and version among them) and nvcc's version, and launched through ctypes on torch's current stream.

It reads the layer's codes in place (GPTQ's unsigned codes, as the other kernels do) with two small bf16 tensors of
its own (:func:`prepare`, made once at load for the layers it serves): the scales, and the zero terms
``-zero x scale`` (zero 8 where symmetric) that CUTLASS adds to code x scale. Nothing here fails a user's command
for want of a compiler or of CUTLASS: :func:`library` returns None with one log line, :func:`supports` says what
the kernel cannot take, and :func:`available` both. The reference is ``w4a16_weights.w4a16_matmul_ref``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
from pathlib import Path

import torch

from quantkit.kernels.device_info import capability
from quantkit.kernels.w4a16_configs import CUTLASS_TILE_K, CutlassConfig, codes_per_scale
from quantkit.kernels.w4a16_cuda import built_library, nvcc_path
from quantkit.kernels.w4a16_weights import CutlassOperands, W4A16Weights

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("w4a16_cutlass.cu")
# -DNDEBUG: CUTLASS's asserts are function calls, and a call inside the mainloop makes ptxas serialize its wgmmas
# (warning C7510 in a build without it)
_NVCC_FLAGS = ("-O3", "-DNDEBUG", "-std=c++17", "--expt-relaxed-constexpr")

__all__ = ["CutlassConfig", "CutlassOperands", "available", "buildable", "include_dirs", "library", "prepare",
           "supports", "w4a16_cutlass_matmul"]


def include_dirs() -> list[Path] | None:
    """CUTLASS's header folders: under ``$QUANTKIT_CUTLASS_DIR`` (a CUTLASS checkout, or the package's ``source``
    folder) if set, else the ``nvidia-cutlass`` package's copy; None where neither has them."""
    root = os.environ.get("QUANTKIT_CUTLASS_DIR")
    if root is None:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or spec.origin is None:
            return None
        root = Path(spec.origin).parent / "source"
    dirs = [Path(root) / "include", Path(root) / "tools" / "util" / "include"]
    return dirs if (dirs[0] / "cutlass" / "cutlass.h").is_file() else None


def build_args(cfg: CutlassConfig, includes: list[Path], signed: bool = False) -> list[str]:
    """nvcc's arguments for one variant (sm_90a only: the kernel is Hopper's wgmma and TMA); ``signed``: the
    bench's comparison build (``QK_SIGNED`` in the source)."""
    defines = [f"-DQK_TILE_N={cfg.TILE_N}", f"-DQK_TILE_M={cfg.TILE_M}", f"-DQK_CLUSTER_N={cfg.CLUSTER_N}",
               f"-DQK_PINGPONG={int(cfg.PINGPONG)}", f"-DQK_SIGNED={int(signed)}"]
    version = includes[0] / "cutlass" / "version.h"
    if version.is_file():  # unused by the source: it puts CUTLASS's version into the build cache's key
        defines.append(f"-DQK_CUTLASS_VERSION_H={hashlib.sha256(version.read_bytes()).hexdigest()[:12]}")
    return [*_NVCC_FLAGS, "-gencode=arch=compute_90a,code=sm_90a", *defines, *(f"-I{d}" for d in includes),
            "-shared", "-Xcompiler", "-fPIC"]


def buildable() -> bool:
    """Whether this machine has what a build needs (nvcc and CUTLASS's headers); the build itself may still fail."""
    return nvcc_path() is not None and include_dirs() is not None


@functools.cache
def library(cfg: CutlassConfig, cap: tuple[int, int], signed: bool = False):
    """The compiled library of one config, built on first use; None (and one log line) off Hopper, without nvcc
    or CUTLASS's headers, or where the build or load fails. ``signed``: the bench's comparison build."""
    if cap != (9, 0):
        return None
    nvcc, includes = nvcc_path(), include_dirs()
    if nvcc is None or includes is None:
        log.warning("W4A16 CUTLASS prefill kernel: %s; the Triton kernels serve",
                    "no nvcc on this machine" if nvcc is None else "CUTLASS's headers are not installed "
                    "(pip install 'quantkit[cutlass]', or set QUANTKIT_CUTLASS_DIR)")
        return None
    # about a minute a config on one core: CUTLASS's templates
    lib = built_library(nvcc, SOURCE, build_args(cfg, includes, signed), "w4a16_cutlass",
                        f"W4A16 CUTLASS prefill kernel {cfg}{' (signed codes)' if signed else ''}", timeout=1200)
    if lib is None:
        return None
    lib.qk_cutlass_gemm.restype = ctypes.c_int
    lib.qk_cutlass_gemm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 2
    lib.qk_cutlass_workspace.restype = ctypes.c_longlong
    lib.qk_cutlass_workspace.argtypes = [ctypes.c_int] * 4
    return lib


def kernel_group(w: W4A16Weights) -> int | None:
    """The group length the kernel takes for ``w`` (K for per-channel scales), None where it takes none."""
    return None if w.group_size is None else codes_per_scale(w.group_size, w.in_features)


def supports(x: torch.Tensor, w: W4A16Weights) -> tuple[bool, str]:
    """Whether the kernel can take the call at all (before any build)."""
    if not x.is_cuda or capability(x.device) != (9, 0):
        return False, "needs a Hopper (sm_90) GPU"
    if x.dtype != torch.bfloat16:
        return False, f"activations are {x.dtype}, this build takes bfloat16"
    group = kernel_group(w)
    if w.bits != 4 or group is None or group % CUTLASS_TILE_K or w.in_features % CUTLASS_TILE_K:
        return False, f"needs 4-bit codes, K and groups multiples of {CUTLASS_TILE_K}"
    if w.out_features % 8:
        return False, "needs N a multiple of 8 (16-byte output rows for the TMA store)"
    return True, ""


def available(x: torch.Tensor, w: W4A16Weights, cfg: CutlassConfig) -> tuple[bool, str]:
    """Whether ``cfg`` can serve the call here: supported, and its library built (building it now if needed)."""
    ok, reason = supports(x, w)
    if not ok:
        return ok, reason
    if library(cfg, capability(x.device)) is None:
        return False, _NOT_BUILT
    return True, ""


_NOT_BUILT = "not built here (no nvcc or CUTLASS headers, or the build failed: see the log)"


def prepare(w: W4A16Weights) -> CutlassOperands:
    """The kernel's operands for ``w``: its codes as they are, bf16 scales and the zero terms ``-zero x scale``
    (the dequantized weight is ``code x scale + term``: CUTLASS multiplies, then adds, each rounded to bf16)."""
    scales = w.scales.to(torch.bfloat16)
    zeros = 8.0 if w.zeros is None else w.zeros.float()
    zero_terms = (-zeros * scales.float()).to(torch.bfloat16)
    return CutlassOperands(w.qweight, scales, zero_terms, kernel_group(w))


def w4a16_cutlass_matmul(x: torch.Tensor, w: W4A16Weights, cfg: CutlassConfig,
                         operands: CutlassOperands | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T`` (bf16) through the CUTLASS kernel ``cfg`` on ``operands`` (else ``w.cutlass``, made at
    load for the layers a CUTLASS entry serves; else made here, two small elementwise passes); raises (never falls
    back) where it cannot run. Operands without zero terms (the bench's signed copy) go to the signed build."""
    prepared = operands if operands is not None else w.cutlass
    signed = prepared is not None and prepared.zero_terms is None
    ok, reason = supports(x, w)
    if ok and signed and w.zeros is not None:
        ok, reason = False, "the signed build takes symmetric layers only"
    lib = library(cfg, capability(x.device), signed) if ok else None
    if lib is None:
        raise ValueError(f"the CUTLASS W4A16 kernel cannot run this call: {reason or _NOT_BUILT}")
    if prepared is None:  # only once the call is known to run
        prepared = prepare(w)
    if w.perm is not None:
        x = x[:, w.perm]
    x = x.contiguous()
    m, k = x.shape
    n = w.out_features
    group = prepared.group
    out = torch.empty((m, n), device=x.device, dtype=torch.bfloat16)
    ws_bytes = lib.qk_cutlass_workspace(m, n, k, group)
    ws = torch.empty(max(ws_bytes, 1), device=x.device, dtype=torch.uint8)
    zero_terms = prepared.scales if signed else prepared.zero_terms  # the signed build reads none
    err = lib.qk_cutlass_gemm(prepared.codes.data_ptr(), x.data_ptr(), prepared.scales.data_ptr(),
                              zero_terms.data_ptr(), out.data_ptr(), m, n, k, group, ws.data_ptr(),
                              ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream))
    if err >= 2000:
        raise ValueError(f"the CUTLASS W4A16 kernel {cfg} cannot take M={m}, N={n}, K={k}, group {group} "
                         f"(cutlass::Status {err - 2000})")
    if err:
        raise RuntimeError(f"the CUTLASS W4A16 kernel failed (status {err})")
    return out
