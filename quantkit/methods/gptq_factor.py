"""GPTQ's factor: the upper Cholesky factor of the damped inverse Hessian, with as few matrices alive as possible.

Split from :mod:`quantkit.methods.gptq` (the solver); the method's module docstring says which precision runs
where. ``damped_inverse_factor`` takes the Hessian as a tensor or as a
:class:`~quantkit.methods.hessian_spill.SpilledHessian` (rows read back from a file on the host).
"""

from __future__ import annotations

import warnings

import torch


def damped_inverse_factor(
    H: torch.Tensor, damp: float, max_escalations: int, name: str = "", perm: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor ``U`` of ``(H + d I)^-1`` (float32 ``[in, in]``) and the damping used;
    with ``perm``, of the permuted ``H[perm][:, perm]`` (built here, so no permuted copy outlives it).

    One Cholesky factorization and one triangular inverse in float64: with ``J`` the reversal permutation
    and ``J H J = L L^T``, ``H^-1 = (J L^-1 J)^T (J L^-1 J)`` and ``J L^-1 J`` is upper triangular with a
    positive diagonal, so it is the (unique) upper Cholesky factor of ``H^-1``: the same matrix as
    ``cholesky(cholesky_inverse(cholesky(H)), upper=True)`` up to float64 rounding, with a third of the
    arithmetic and two float64 matrices alive instead of three (each 1.6 GB for an 8B model's down_proj);
    on the host one, both steps in place (``_inverse_factor_in_place``). On failure the damping is
    multiplied by 10, up to ``max_escalations`` times, with a warning; then a ``FloatingPointError``
    names the layer.
    """
    n = H.shape[0]
    rev = torch.arange(n - 1, -1, -1, device=H.device)  # J
    order = rev if perm is None else perm[rev]
    mean_diag = float(H.diagonal().double().mean())  # (a SpilledHessian has its diagonal in memory)
    idx = torch.arange(n, device=H.device)
    d = damp
    host = H.device.type == "cpu"
    for attempt in range(max_escalations + 1):
        if host:  # float32 in place; float64 when float32 is not enough at this damping
            U = _inverse_factor_in_place(H, order, idx, d * mean_diag, torch.float32)
            if U is None:
                U = _inverse_factor_in_place(H, order, idx, d * mean_diag, torch.float64)
        else:
            U = _inverse_factor(H, order, idx, d * mean_diag)
        if U is not None:
            return U, d
        if attempt < max_escalations:
            new_d = max(d * 10.0, 1e-6)
            warnings.warn(
                f"GPTQ {name or 'layer'}: Cholesky factorization failed with damp={d:g}; "
                f"escalating damping to {new_d:g} of the mean Hessian diagonal",
                RuntimeWarning, stacklevel=2,
            )
            d = new_d
    raise FloatingPointError(
        f"GPTQ {name or 'layer'}: the Hessian is not positive definite even with damp={d:g}; "
        "check the calibration data (NaN/Inf activations?) or raise --damp"
    )


def _inverse_factor(H: torch.Tensor, order: torch.Tensor, idx: torch.Tensor, shift: float) -> torch.Tensor | None:
    """``J L^-1 J`` (float32) for ``J P H P^T J + shift I = L L^T``, or None when the factorization fails or
    gives non-finite values: the factor and its inverse as two float64 matrices (the accelerator path;
    measured on the H200, see ``_inverse_factor_in_place``)."""
    n = H.shape[0]
    Hd = H[order[:, None], order].double()  # J P H P^T J, converted again on every attempt
    Hd[idx, idx] += shift
    L, info = torch.linalg.cholesky_ex(Hd)
    del Hd
    if int(info) != 0:
        return None
    Linv = torch.eye(n, dtype=L.dtype, device=L.device)
    torch.linalg.solve_triangular(L, Linv, upper=False, out=Linv)  # L^-1
    del L
    U = Linv.flip((0, 1))  # J L^-1 J
    del Linv
    return U.float() if torch.isfinite(U).all() else None


def _inverse_factor_in_place(H: torch.Tensor, order: torch.Tensor, idx: torch.Tensor, shift: float,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """``_inverse_factor`` with one matrix alive, of ``dtype`` (the host path, where it bounds resident memory:
    float32 is one 4-byte matrix where the accelerator path holds two 8-byte ones). The matrix is stored
    column-major, the layout LAPACK factors in, so the Cholesky works in place (any other layout makes
    torch factor a copy); the triangular inverse is blocked in place (``invert_lower_``), and the flip to
    ``J L^-1 J`` in row-major order is a reflection of the buffer in place (``anti_transpose_``). The
    permuted copy of ``H`` is gathered in row blocks, so no second whole matrix is made. On the H200 the
    float64 in-place variant measured 8.78 GiB of peak device memory for an 8B GPTQ --desc-act walk
    against 7.25 with ``_inverse_factor`` (cause not found), so accelerators keep that one."""
    n = H.shape[0]
    L = torch.empty_strided((n, n), (1, n), dtype=dtype, device=H.device)
    step = max(1, (1 << 22) // max(n, 1))  # rows of the permuted copy gathered at a time (16 MB of float32)
    for r0 in range(0, n, step):
        rows = order[r0 : r0 + step]
        L[r0 : r0 + step].copy_(H[rows[:, None], order] if isinstance(H, torch.Tensor) else H.rows(rows)[:, order])
    L[idx, idx] += shift
    L, info = _cholesky_in_place(L)
    if int(info) != 0:
        return None
    invert_lower_(L)  # L^-1, in place
    # L is column-major: its buffer is the row-major matrix L^-T, whose anti-transpose is J L^-1 J
    U = anti_transpose_(L.t())
    if U.dtype != torch.float32:
        U = U.float()
    return U if all_finite(U) else None


def all_finite(t: torch.Tensor, chunk_elements: int = 1 << 22) -> bool:
    """``torch.isfinite(t).all()`` a block at a time: ``isfinite`` of a float tensor makes a whole ``abs``
    copy and a mask besides (measured: +447 MiB of peak for an 8192 x 8192 float32 matrix). The blocks'
    flags are folded into one on the tensor's device and read once: one host round trip a call, not one a
    block (49 for an 8B model's down_proj Hessian)."""
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    ok = torch.ones((), dtype=torch.bool, device=flat.device)
    for part in flat.split(chunk_elements):
        ok &= torch.isfinite(part).all()
    return bool(ok)


def anti_transpose_(A: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Reflect the contiguous square ``A`` across its anti-diagonal in place (``A[i, j] <- A[n-1-j, n-1-i]``,
    i.e. ``J A^T J``) and return it; blocks of at most ``block`` rows are swapped through one temporary."""
    n = A.shape[0]
    assert A.is_contiguous() and A.shape == (n, n), (A.shape, A.stride())
    low = list(range(0, (n + 1) // 2, block))
    edges = sorted({0, n, *low, *(n - e for e in low)})
    spans = list(zip(edges[:-1], edges[1:]))
    for r0, r1 in spans:
        for c0, c1 in spans:
            p = (n - c1, n - c0, n - r1, n - r0)  # the block this one is swapped with
            if (p[0], p[2]) < (r0, c0):
                continue  # done from the other side
            mine = A[r0:r1, c0:c1]
            if p == (r0, r1, c0, c1):
                mine.copy_(mine.flip((0, 1)).t().clone())
                continue
            other = A[p[0] : p[1], p[2] : p[3]]
            tmp = mine.clone()
            mine.copy_(other.flip((0, 1)).t())
            other.copy_(tmp.flip((0, 1)).t())
    return A


def _cholesky_in_place(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower Cholesky factor of the column-major ``A``, written over it: (L, info). Should a backend
    refuse the aliased output, the ordinary call (one more matrix) gives the same factor."""
    info = torch.empty((), dtype=torch.int32, device=A.device)
    try:
        torch.linalg.cholesky_ex(A, out=(A, info))
        return A, info
    except RuntimeError:
        return torch.linalg.cholesky_ex(A)


def invert_lower_(L: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Invert the lower-triangular ``L [n, n]`` in place (its upper triangle must be zero) and return it.

    With ``L = [[A, 0], [B, C]]``, ``L^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]``: the off-diagonal block
    from two triangular solves, then both diagonal blocks the same way, recursively down to ``block``
    columns, where one ``solve_triangular`` against the identity does it. The temporaries are one panel of
    ``block`` rows or columns, where ``solve_triangular(L, I)`` needs a second whole matrix (1.5 GiB in
    float64 for an 8B model's down_proj)."""
    n = L.shape[0]
    if n <= block:
        eye = torch.eye(n, dtype=L.dtype, device=L.device)
        L.copy_(torch.linalg.solve_triangular(L, eye, upper=False))
        return L
    h = n // 2
    A, B, C = L[:h, :h], L[h:, :h], L[h:, h:]
    # -C^-1 B A^-1 into B, in panels of ``block`` rows (right solve: rows are independent), then of ``block``
    # columns (left solve: columns are independent): the temporaries are one panel, not a quarter of L
    for r in range(0, B.shape[0], block):
        B[r : r + block].copy_(torch.linalg.solve_triangular(A, B[r : r + block], upper=False, left=False))
    for c in range(0, B.shape[1], block):
        B[:, c : c + block].copy_(torch.linalg.solve_triangular(C, B[:, c : c + block], upper=False).neg_())
    invert_lower_(A, block)
    invert_lower_(C, block)
    return L
