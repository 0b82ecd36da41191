"""The L2 prefetch kernel (kernels/l2_prefetch.py): its sm_90 machine code compiled on the CPU (the interpreter
runs no inline assembly), the launcher's refusals and no-ops, and on the GPU that it changes no value."""

from __future__ import annotations

import re

import pytest
import torch

from quantkit.kernels.l2_prefetch import LINE_BYTES, LINES_PER_PROGRAM, MAX_RANGES, l2_prefetch, prefetch_bytes


def test_prefetch_compiles_to_l2_prefetches_between_the_pdl_calls(sm90, tmp_path):
    """PTX: the next kernel may launch first, then the prefetches, then the wait for the previous grid (which
    keeps the chain: the kernel after this one waits for this one only). SASS: the prefetches are L2 prefetch
    instructions (CCTL), one per line a thread owns, and nothing is loaded into registers."""
    signature = {name: "i64" for name in ("a0", "a1", "a2", "a3")}
    signature.update({name: "i32" for name in ("n0", "n1", "n2", "n3", "end0", "end1", "end2")})
    ptx = sm90.triton_ptx(str(tmp_path / "pf.ptx"), "quantkit.kernels.l2_prefetch", "_l2_prefetch_kernel",
                          signature, dict(LINES=LINES_PER_PROGRAM, LINE=LINE_BYTES, PDL=True), num_warps=4)
    text = open(ptx).read()
    first_prefetch = text.find("prefetch.global.L2")
    assert 0 <= text.find("griddepcontrol.launch_dependents") < first_prefetch < text.find("griddepcontrol.wait")
    assert text.count("prefetch.global.L2") == LINES_PER_PROGRAM // 128  # 4 warps: 8 lines a thread
    sass = sm90.sass(sm90.cubin(ptx))
    prefetches = [line for line in sass if re.search(r"\bCCTL\b.*PF2", line)]
    assert len(prefetches) == LINES_PER_PROGRAM // 128, "\n".join(sass)
    assert not [line for line in sass if re.search(r"\bLDG\b", line)], "\n".join(sass)


def test_prefetch_bytes_caps_at_the_tensor_and_the_budget():
    t = torch.zeros(10, 100, dtype=torch.bfloat16)
    assert prefetch_bytes(t, 1 << 20) == 2000
    assert prefetch_bytes(t, 512) == 512
    assert prefetch_bytes(t, -5) == 0


def test_off_the_gpu_nothing_is_launched_and_bad_ranges_are_refused():
    t = torch.zeros(64, 64, dtype=torch.float16)
    assert l2_prefetch([(t, 1 << 20)]) == 0
    assert l2_prefetch([]) == 0
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch([(t, 1), (t.T, 1 << 20)])
    with pytest.raises(ValueError, match=f"at most {MAX_RANGES}"):
        l2_prefetch([(t, 1)] * (MAX_RANGES + 1))


@pytest.mark.gpu
def test_prefetch_launches_its_programs_and_changes_nothing():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    w = torch.randn(4096, 4096, device="cuda").to(torch.float8_e4m3fn)
    v = torch.randn(1000, 7, device="cuda")
    before = (w.clone(), v.clone())
    per_program = LINE_BYTES * LINES_PER_PROGRAM
    assert l2_prefetch([(w, 8 << 20)]) == (8 << 20) // per_program
    assert l2_prefetch([(w[:3], 1 << 30)]) == 1  # 12 KB: one program, most of its lines masked off
    assert l2_prefetch([(w, 0)]) == 0
    # four ranges in one launch: 2 + 1 + 1 + 3 programs (the third, 28 KB, in one)
    assert l2_prefetch([(w, 2 * per_program), (w[4:], 100), (v, 1 << 30), (w[8:], 3 * per_program)]) == 7
    torch.cuda.synchronize()
    assert torch.equal(w.view(torch.uint8), before[0].view(torch.uint8)) and torch.equal(v, before[1])
