"""Run the Triton kernels under the interpreter when no GPU is present.

Triton decides interpretation when a kernel is decorated (module import), so this must run before
the kernel modules are imported; test_w4a16 re-imports its module if some earlier test got there
first.
"""

import json
import os
import re
import subprocess
import sys

import pytest
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


_COMPILE_TRITON = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

spec = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
# a constexpr "tl.NAME" is that triton.language dtype (JSON carries no dtypes)
constexprs = {name: getattr(triton.language, value[3:]) if isinstance(value, str) and value.startswith("tl.") else value
              for name, value in spec["constexprs"].items()}
signature = dict(spec["signature"], **{name: "constexpr" for name in constexprs})
# what Triton's launcher specializes at run time: 16-byte aligned pointers, integers divisible by 16
attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in spec["aligned"]}
kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                        target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": spec["num_warps"], "num_stages": spec.get("num_stages") or 3})
open(spec["out"], "w").write(kernel.asm["ptx"])
"""


class Sm90Tools:
    """Triton's own ptxas and nvdisasm, for the tests that compile Gluon kernels for sm_90 on the CPU (Gluon has
    no interpreter) and read their machine code."""

    def __init__(self, bin_dir: str):
        self.bin_dir = bin_dir

    def compile(self, script: str, *args: str) -> None:
        """Run a compile script in a fresh interpreter: the kernel tests run Triton's interpreter, which patches
        Triton's tensor methods for the rest of the process (a Gluon compile after it fails in ``.to()``)."""
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]

    def triton_ptx(self, out: str, module: str, kernel: str, signature: dict[str, str], constexprs: dict,
                   num_warps: int, aligned: tuple[str, ...] = (), num_stages: int | None = None) -> str:
        """``module.kernel`` (a ``@triton.jit`` function) compiled for sm_90 with these argument types and
        constexprs; its PTX written to ``out`` (the path, returned) for :meth:`ptxas_notices`. ``aligned``: the
        arguments to compile as Triton's launcher specializes them when they are 16-byte aligned pointers or
        integers divisible by 16 (the vector widths of the loads depend on it; an integer equal to 1 it makes a
        constexpr: pass those in ``constexprs``). ``num_stages``: the software pipeline's depth (Triton's default,
        3, when None)."""
        spec = dict(out=out, module=module, kernel=kernel, signature=signature, constexprs=constexprs,
                    num_warps=num_warps, aligned=list(aligned), num_stages=num_stages)
        self.compile(_COMPILE_TRITON, json.dumps(spec))
        return out

    def cubin(self, ptx: str) -> str:
        """``ptx`` assembled for sm_90a (beside it, ``.cubin``), for :meth:`sass`."""
        out = ptx + ".cubin"
        done = self._run("ptxas", "-arch=sm_90a", "-o", out, ptx)
        assert done.returncode == 0, done.stderr[-2000:]
        return out

    def sass(self, cubin: str) -> list[str]:
        """The instruction lines of a cubin's SASS."""
        return [line for line in self.sass_text(cubin).splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]

    def sass_text(self, cubin: str) -> str:
        """A cubin's whole disassembly, branch labels included."""
        return self._run("nvdisasm", "-c", cubin).stdout

    def ptxas_notices(self, ptx: str) -> str:
        """ptxas's report on a PTX file: registers, spills, and notices such as "wgmma serialized" (C7514)."""
        return self._run("ptxas", "-arch=sm_90a", "-v", "-o", os.devnull, ptx).stderr

    def _run(self, tool: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([os.path.join(self.bin_dir, tool), *args], capture_output=True, text=True)


@pytest.fixture(scope="session")
def sm90() -> Sm90Tools:
    triton = pytest.importorskip("triton")
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not all(os.path.exists(os.path.join(bin_dir, tool)) for tool in ("ptxas", "nvdisasm")):
        pytest.skip("this triton build ships no ptxas/nvdisasm")
    return Sm90Tools(bin_dir)
