"""Run the Triton kernels under the interpreter when no GPU is present.

Triton decides interpretation when a kernel is decorated (module import), so this must run before
the kernel modules are imported; test_w4a16 re-imports its module if some earlier test got there
first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_index():
    """Triton 3.6's interpreter turns a scalar into a loop bound with ``int(np.array([v]))``, which
    NumPy >= 2.4 rejects ("only 0-dimensional arrays can be converted to Python scalars"), so any
    ``range(start, end)`` with run-time bounds fails. Read the single element instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_index()
