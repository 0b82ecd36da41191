"""A Hessian parked in a temporary file while GPTQ factors it and solves the columns (host, streamed runs).

GPTQ needs ``H [in, in]`` twice: to build the factor of its damped inverse, and at the end for the output
errors it reports. In between, the factor (one more ``[in, in]`` float32 matrix) and the column solve run
with ``H`` idle; for a streamed model on the CPU, ``H`` and the factor together are the peak (an 8192-wide
down_proj: 268 MB each). ``SpilledHessian`` writes ``H``'s bytes to an unlinked temporary file and gives
its storage back (resized to zero, so every view of it, the accumulator's included, holds no memory);
the factor is built from row blocks read back from the file, and ``restore`` refills the same storage.
The file lives in the page cache, which the kernel writes back and reclaims under pressure: it is not the
process's resident memory. Used only where the caller allows it (``gptq_quantize(..., spill_hessian=True)``).
"""

from __future__ import annotations

import tempfile

import torch

_CHUNK = 1 << 22  # float32 values written or read back at a time


class SpilledHessian:
    """``H`` (contiguous float32 on the CPU) moved to a temporary file; ``diag`` stays in memory and replaces
    the diagonal of every row block read (so damping changes to it, e.g. dead columns set to 1, apply)."""

    def __init__(self, H: torch.Tensor) -> None:
        assert H.device.type == "cpu" and H.is_contiguous() and H.dtype == torch.float32, (H.device, H.dtype)
        self.H = H
        self.shape = H.shape
        self.device = H.device
        self.diag = torch.diagonal(H).clone()
        self._file = tempfile.TemporaryFile(prefix="quantkit-hessian-")
        # through copies of one chunk: a numpy view of H itself would pin its storage (no resize)
        flat = H.reshape(-1)
        for part in flat.split(_CHUNK):
            self._file.write(memoryview(part.clone().view(torch.uint8).numpy()))
        self._file.flush()
        self._nbytes = H.untyped_storage().nbytes()
        H.untyped_storage().resize_(0)

    def diagonal(self) -> torch.Tensor:
        return self.diag

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """``H[index]`` (``[k, n]``), its entries ``(index[i], index[i])`` taken from ``diag``."""
        n = self.shape[1]
        out = torch.empty(len(index), n, dtype=torch.float32)
        view = out.view(torch.uint8).numpy()
        row_bytes = n * 4
        for i, r in enumerate(index.tolist()):
            self._file.seek(r * row_bytes)
            got = self._file.readinto(memoryview(view[i]))
            assert got == row_bytes, (got, row_bytes)
        out[torch.arange(len(index)), index] = self.diag[index]
        return out

    def restore(self) -> torch.Tensor:
        """Refill ``H``'s storage from the file (its original values) and close the file; returns ``H``."""
        storage = self.H.untyped_storage()
        storage.resize_(self._nbytes)
        self._file.seek(0)
        for part in self.H.reshape(-1).split(_CHUNK):
            buf = torch.empty(part.numel(), dtype=torch.float32)
            view, got = memoryview(buf.view(torch.uint8).numpy()), 0
            while got < len(view):
                n = self._file.readinto(view[got:])
                assert n, "the spilled Hessian's file ended early"
                got += n
            part.copy_(buf)
        self._file.close()
        return self.H
