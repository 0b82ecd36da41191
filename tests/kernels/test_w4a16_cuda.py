"""The CUDA C++ W4A16 decode GEMM (kernels/w4a16_cuda.cu, .py): fallbacks, selection, build and results.

CPU: a missing nvcc or a failed build gives None and one log line (never an error); a ``cuda`` choice runs its
fallback where the kernel is unavailable; the shipped table has no ``cuda`` entry, and one would serve only its
exact cell; the kernel's lane/fragment mapping, emulated in torch, computes the reference's sums; where nvcc is
present, the sm_90a build of every benchmarked config uses 128-bit weight loads and does not spill.
GPU (marker ``gpu``, skipped without nvcc too): the kernel against ``w4a16_matmul_ref``.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantkit.kernels import w4a16_cuda
from quantkit.kernels.w4a16_configs import CudaConfig, GemvConfig, config_from_dict, config_label, config_to_dict
from quantkit.kernels.w4a16_select import KernelChoice, _measured_exact, facts_of, load_table, select_w4a16

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = [(28672, 8192), (8192, 28672), (14336, 4096), (4096, 4096), (6144, 4096)]


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTKIT_CUDA_CACHE", str(tmp_path / "cache"))
    w4a16_cuda.library.cache_clear()
    yield
    w4a16_cuda.library.cache_clear()


def test_no_nvcc_gives_none_and_a_log_line(monkeypatch, fresh_library, caplog):
    monkeypatch.setattr(w4a16_cuda, "nvcc_path", lambda: None)
    with caplog.at_level(logging.WARNING, logger=w4a16_cuda.__name__):
        assert w4a16_cuda.library(CudaConfig(), 1, True, False, (9, 0)) is None
    assert "no nvcc" in caplog.text and "Triton kernels serve" in caplog.text
    assert w4a16_cuda.compile_cubin(Path("unused.cubin"), CudaConfig()) is None


def test_a_failed_build_gives_none_and_the_compiler_output(monkeypatch, fresh_library, tmp_path, caplog):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'fake nvcc 0.0'; exit 0; fi\n"
                    "echo 'error: planted failure' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(w4a16_cuda, "nvcc_path", lambda: str(fake))
    with caplog.at_level(logging.WARNING, logger=w4a16_cuda.__name__):
        assert w4a16_cuda.library(CudaConfig(), 1, True, False, (9, 0)) is None
    assert "nvcc failed" in caplog.text and "planted failure" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-written library left behind


def test_a_cuda_choice_runs_its_fallback_where_the_kernel_cannot(monkeypatch):
    from quantkit.kernels import w4a16

    calls = []
    run = w4a16._cuda_launcher(CudaConfig(), lambda x, w: calls.append(x.shape) or "fallback")
    x = torch.zeros(1, 256, dtype=torch.bfloat16)  # on the CPU: the CUDA kernel says no before any build
    monkeypatch.setattr(w4a16_cuda, "library", lambda *a: pytest.fail("no build off CUDA"))
    assert run(x, object()) == "fallback" and run(x, object()) == "fallback" and len(calls) == 2


def test_the_shipped_cuda_entries_name_their_card_and_the_h200_keeps_gluon():
    """The CUDA entries were measured on an H100 only (docs/kernels.md): each names that card, and on the H200
    (or a plan without a card) the README layers keep the Gluon picks."""
    cuda = [e for e in load_table() if e["kernel"] == "cuda"]
    assert cuda and all(e.get("card") == "NVIDIA H100 80GB HBM3" for e in cuda)
    for n, k in LLAMA_8B + [(e["n"], e["k"]) for e in cuda]:
        for m in (1, 4, 8, 16):
            for card in (None, "NVIDIA H200"):
                choice = select_w4a16(m, facts_of(n, k, 4, 128, True, False), "sm90", card)
                assert choice.kernel == "gluon" and choice.fallback is None, (n, k, m, card, choice)


def test_a_cuda_entry_serves_only_its_measured_cell():
    facts = facts_of(28672, 8192, 4, 128, True, False)
    table = [dict(n=28672, k=8192, m=1, kernel="cuda", config=CudaConfig(2, 2, 4), source="test")]
    today = select_w4a16(1, facts, "sm90")
    picked = _measured_exact(1, facts, "sm90", None, table, today)
    assert picked.kernel == "cuda" and picked.config == CudaConfig(2, 2, 4) and picked.fallback == today
    assert _measured_exact(2, facts, "sm90", None, table, today) is None  # another bucket
    assert _measured_exact(1, facts_of(28672, 4096, 4, 128, True, False), "sm90", None, table, today) is None  # shape
    assert _measured_exact(1, facts_of(28672, 8192, 4, 64, True, False), "sm90", None, table, today) is None  # g64
    assert _measured_exact(1, facts, "sm80", None, table, today) is None


def test_cuda_configs_round_trip_and_check_their_fields():
    cfg = config_from_dict("cuda", {"R": 4, "U": 1, "W": 8, "SPLITS": 2, "L2_256": True})
    assert cfg == CudaConfig(4, 1, 8, 2, True) and config_label(cfg).startswith("CudaConfig(R=4, U=1, W=8")
    assert cfg.fits(16, 128) and cfg.fits(1, 1 << 30) and not cfg.fits(17, 128) and not cfg.fits(1, 64)
    with pytest.raises(ValueError):
        CudaConfig(R=3)
    assert w4a16_cuda.splits_for(CudaConfig(2, 2, 4), 28672, 64, 660) == 1  # 896 row tiles fill 660 slots
    assert w4a16_cuda.splits_for(CudaConfig(2, 2, 4), 4096, 32, 660) == 4  # 128 row tiles; 32 K tiles / 8 a CTA


def _emulated_kernel_block(words: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The .cu file's per-lane arithmetic for one warp, one block of 16 rows and one K tile, in torch: thread
    (g, t) holds words 4t .. 4t + 3 of rows g and g + 8, pairs p = 4i + j are ``word_i >> 4j`` (low half code j,
    high half code j + 4), activation pairs follow; mma s takes pairs 2s and 2s + 1 as in PTX's m16n8k16 A/B
    fragment layouts, and the C fragment gives (row g (+ 8), activation row 2t (+ 1)). Returns [16, 8] sums of
    (code * x) (codes as numbers, no magic)."""
    c = torch.zeros(16, 8, dtype=torch.float64)
    for s in range(8):
        a = torch.zeros(16, 16, dtype=torch.float64)  # A[row, col] of mma s
        b = torch.zeros(16, 8, dtype=torch.float64)  # B[k, n]
        for g in range(8):
            for t in range(4):
                for row, col0, pair in [(g, 2 * t, 2 * s), (g + 8, 2 * t, 2 * s),
                                        (g, 2 * t + 8, 2 * s + 1), (g + 8, 2 * t + 8, 2 * s + 1)]:
                    i, j = divmod(pair, 4)
                    word = int(words[row, 4 * t + i])
                    a[row, col0] = (word >> (4 * j)) & 0xF
                    a[row, col0 + 1] = (word >> (4 * j + 16)) & 0xF
                for k0, pair in ((2 * t, 2 * s), (2 * t + 8, 2 * s + 1)):
                    i, j = divmod(pair, 4)
                    b[k0, g] = x[g, 32 * t + 8 * i + j]
                    b[k0 + 1, g] = x[g, 32 * t + 8 * i + j + 4]
        c += a @ b
    return c


def test_the_kernels_fragment_mapping_computes_the_dot_products():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 128), generator=gen)
    words = torch.zeros(16, 16, dtype=torch.int64)
    for p in range(8):  # code p of a word at bits 4p: the repacked layout (K contiguous per row)
        words |= codes[:, p::8] << (4 * p)
    x = torch.randn(8, 128, generator=gen, dtype=torch.float64)
    assert torch.allclose(_emulated_kernel_block(words, x), codes.double() @ x.t())


@pytest.mark.skipif(w4a16_cuda.nvcc_path() is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("cfg,mt", [(c, 1) for c in w4a16_cuda.SASS_CONFIGS] + [(CudaConfig(2, 1, 4), 2)])
def test_the_sm90a_build_streams_words_in_128_bit_loads_without_spills(sm90, tmp_path, cfg, mt):
    cubin = tmp_path / "k.cubin"
    log = w4a16_cuda.compile_cubin(cubin, cfg, mt=mt)
    assert " 0 bytes spill stores" in log, log
    ops = [re.search(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line.split("*/", 1)[1]).group(1)
           for line in sm90.sass(str(cubin))]
    weight_loads = [op for op in ops if op.startswith("LDG.E.NA.128")]  # ld.global.nc.L1::no_allocate.v4
    assert len(weight_loads) == 2 * cfg.R * cfg.U  # one batch: every row pair of every K tile
    assert not any(op.startswith(("LDL", "STL")) for op in ops)
    assert sum(op.startswith("HMMA.16816.F32.BF16") for op in ops) == 8 * cfg.U * mt * (cfg.R + 1)
    assert "ACQBULK" not in ops and "PREEXIT" not in ops  # the default build: no PDL instructions
    # the PDL build: the wait for the previous grid (griddepcontrol.wait) before any global load, and the early
    # trigger for the next one (launch_dependents)
    w4a16_cuda.compile_cubin(cubin, cfg, mt=mt, pdl=True)
    ops = [re.search(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line.split("*/", 1)[1]).group(1)
           for line in sm90.sass(str(cubin))]
    first_load = next(i for i, op in enumerate(ops) if op.startswith("LDG"))
    assert "ACQBULK" in ops[:first_load] and "PREEXIT" in ops
    # before the wait, the first batch's weight words asked into L2 (constants: no dependence on that grid)
    prefetches = [i for i, op in enumerate(ops) if op.startswith("CCTL.E.PF2")]
    assert len(prefetches) == 2 * cfg.R * cfg.U and max(prefetches) < ops.index("ACQBULK")


@pytest.mark.parametrize("script", ["bench/bench_w4a16_decode.py", "bench/bench_w4a16_chain.py",
                                    "bench/sass_w4a16_decode.py", "bench/sass_fp8_gemv.py"])
def test_the_scripts_answer_help_without_a_gpu(script):
    done = subprocess.run([sys.executable, str(REPO / script), "--help"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and "usage" in done.stdout


# --- GPU -------------------------------------------------------------------------------------------------------

GPU_CASES = [  # n, k, group, sym, act_order, m, dtype, config
    (256, 1024, 128, True, False, 1, torch.bfloat16, CudaConfig(2, 2, 4)),
    (200, 1024, 128, False, False, 3, torch.bfloat16, CudaConfig(2, 1, 4)),  # N off the row tile, asym
    (512, 2048, 256, True, False, 8, torch.float16, CudaConfig(4, 1, 4)),
    (512, 1024, -1, False, False, 16, torch.bfloat16, CudaConfig(2, 1, 4)),  # per channel, two n8 tiles
    (384, 1280, 128, True, True, 9, torch.float16, CudaConfig(1, 2, 4)),  # act-order, K not a batch multiple
    (4096, 4096, 128, True, False, 1, torch.bfloat16, CudaConfig(2, 2, 8, SPLITS=3)),  # split K, workspace
    (4096, 4096, 128, False, False, 16, torch.bfloat16, CudaConfig(2, 2, 4, SPLITS=2, L2_256=True)),
]


@pytest.mark.gpu
@pytest.mark.skipif(w4a16_cuda.nvcc_path() is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("n,k,group,sym,act_order,m,dtype,cfg", GPU_CASES)
def test_cuda_kernel_matches_the_reference(n, k, group, sym, act_order, m, dtype, cfg):
    from quantkit.kernels.w4a16_weights import prepare_w4a16_weights, w4a16_matmul_ref
    from tests.kernels.test_w4a16 import make_layer

    tensors, _ = make_layer(n, k, 4, group, sym, act_order, device="cuda")
    w = prepare_w4a16_weights(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], 4, group,
                              sym)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    ok, reason = w4a16_cuda.available(x, w, cfg)
    assert ok, reason
    ref = w4a16_matmul_ref(x, w).float()
    for _ in range(2):  # the second call finds the workspace the first left
        out = w4a16_cuda.w4a16_cuda_matmul(x, w, cfg)
        torch.cuda.synchronize()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < (8e-3 if dtype == torch.bfloat16 else 2e-3), err
    if w.partial_sums is not None:
        assert not w.partial_sums.any() and not w.tile_counters.any()


@pytest.mark.gpu
def test_a_cuda_choice_serves_through_the_bound_launcher():
    from quantkit.kernels import w4a16
    from quantkit.kernels.w4a16_weights import prepare_w4a16_weights, w4a16_matmul_ref
    from tests.kernels.test_w4a16 import make_layer

    tensors, _ = make_layer(256, 1024, 4, 128, True, False, device="cuda")
    w = prepare_w4a16_weights(tensors["qweight"], tensors["qzeros"], tensors["scales"], None, 4, 128, True)
    fallback = KernelChoice("gemv", GemvConfig(8, 128, 4, PIPE=3, SPLIT_K=1), "test")
    run = w4a16.bind_launcher(KernelChoice("cuda", CudaConfig(), "test", fallback), w.facts(), 1)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    ref = w4a16_matmul_ref(x, w).float()
    assert ((run(x, w).float() - ref).abs().max() / ref.abs().max()).item() < 8e-3


@pytest.mark.gpu
@pytest.mark.skipif(w4a16_cuda.nvcc_path() is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_cuda_kernel_after_a_pdl_producer_in_a_graph(monkeypatch, pdl):
    """The kernel launched with programmatic dependent launch (QUANTKIT_W4A16_CUDA_PDL=1) right behind the fused
    add + RMSNorm that writes its input (a PDL kernel too), replayed from a CUDA graph with new inputs each time:
    it must read the producer's output, never the previous replay's (its griddepcontrol.wait), and leave the
    split-K workspace zeroed."""
    from quantkit.kernels.decoder_ops import add_rms_norm
    from quantkit.kernels.w4a16_weights import prepare_w4a16_weights, w4a16_matmul_ref
    from tests.kernels.test_w4a16 import make_layer

    monkeypatch.setenv("QUANTKIT_W4A16_CUDA_PDL", pdl)
    assert w4a16_cuda.cuda_pdl(torch.device("cuda")) == (pdl == "1" and torch.cuda.get_device_capability() >= (9, 0))
    n, k, cfg = 4096, 4096, CudaConfig(2, 2, 4, SPLITS=2)
    tensors, _ = make_layer(n, k, 4, 128, True, False, device="cuda")
    w = prepare_w4a16_weights(tensors["qweight"], tensors["qzeros"], tensors["scales"], None, 4, 128, True)
    h, r = torch.randn(1, k, device="cuda", dtype=torch.bfloat16), torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    ok, reason = w4a16_cuda.available(h, w, cfg)
    assert ok, reason

    def step():
        x, _ = add_rms_norm(h, r, norm_w, 1e-6)
        return x, w4a16_cuda.w4a16_cuda_matmul(x, w, cfg)

    step()  # build and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x_out, y_out = step()
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        h.copy_(torch.randn(h.shape, device="cuda", generator=g))
        r.copy_(torch.randn(r.shape, device="cuda", generator=g))
        graph.replay()
        torch.cuda.synchronize()
        ref = w4a16_matmul_ref(x_out, w).float()
        err = ((y_out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 8e-3, (seed, err)
    assert not w.partial_sums.any() and not w.tile_counters.any()


def test_decode_bench_proposes_cuda_entries_only_past_the_margin(monkeypatch):
    """bench_w4a16_decode.candidate_entries: a CUDA variant faster than today's pick by more than max(0.5 us, 4 %)
    becomes a card-specific entry in the table's own form (which the table reader accepts); a smaller gain, a
    variant that was not timed, or a cell without a timed pick gives none."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from bench_w4a16_decode import candidate_entries

    def cell(n, today, cuda):
        return {"N": n, "K": 4096, "M": 1, "variants": [
            {"name": "today: gluon", "us": today}, {"name": "cuda 2/2/4", "us": cuda, "cuda_config": {}},
            {"name": "cuda 1/4/4", "cuda_config": {"R": 1, "U": 4}}]}  # not timed (an error): never picked

    cells = [cell(28672, 30.0, 26.0), cell(4096, 10.0, 9.7), {"N": 8, "K": 8, "M": 1, "variants": []}]
    entries = candidate_entries(cells, "NVIDIA H100 80GB HBM3")
    assert [(e["n"], e["config"], e["card"]) for e in entries] == [(28672, {}, "NVIDIA H100 80GB HBM3")]
    assert config_from_dict("cuda", entries[0]["config"]) == CudaConfig()


def test_chain_bench_proposes_the_fastest_variant_in_the_chain_past_the_margin(monkeypatch):
    """bench_w4a16_chain.candidate_entries: the variant fastest *after its predecessor* (not alone) becomes a
    card-specific entry, Gluon or CUDA, when it beats today's pick there by more than max(0.3 us, 3 %); the entry is
    in the table's form and the selection serves it on that card."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from bench_w4a16_chain import candidate_entries

    from quantkit.kernels import w4a16_select

    ring = {"BLOCK_N": 128, "BLOCK_M": 16, "NUM_BUF": 8, "CTAS_PER_SM": 2, "X_BOX_K": 64}
    cells = [
        {"N": 4096, "K": 4096, "M": 1, "predecessor": "attention", "variants": [
            {"name": "today: gluon", "alone_us": 7.0, "chain_us": 6.0},
            {"name": "ring", "kernel": "gluon", "config": ring, "alone_us": 8.0, "chain_us": 4.0},
            {"name": "direct", "kernel": "gluon", "config": {"BLOCK_N": 64}, "alone_us": 6.0, "chain_us": 5.5},
            {"name": "cuda", "kernel": "cuda", "config": {}, "max_err": 1.0}]},  # not timed: never picked
        {"N": 6144, "K": 4096, "M": 1, "predecessor": "norm", "variants": [  # 0.25 us: inside the margin
            {"name": "today: gluon", "alone_us": 9.0, "chain_us": 8.0},
            {"name": "cuda", "kernel": "cuda", "config": {}, "alone_us": 9.5, "chain_us": 7.75}]},
        {"N": 28672, "K": 4096, "M": 1, "predecessor": "norm", "variants": [
            {"name": "today: gluon", "alone_us": 25.0, "chain_us": 24.0},
            {"name": "cuda", "kernel": "cuda", "config": {"W": 8}, "alone_us": 26.0, "chain_us": 22.0}]}]
    card = "NVIDIA H100 80GB HBM3"
    entries = candidate_entries(cells, card)
    assert [(e["n"], e["kernel"], e["config"], e["card"], e["us"]) for e in entries] == [
        (4096, "gluon", ring, card, 8.0), (28672, "cuda", {"W": 8}, card, 26.0)]
    table = tuple(dict(e, config=config_from_dict(e["kernel"], e["config"])) for e in entries)
    shipped = load_table()
    monkeypatch.setattr(w4a16_select, "load_table", lambda: table + shipped)
    choice = select_w4a16(1, facts_of(4096, 4096, 4, 128, True, False), "sm90", card)
    assert (choice.kernel, config_to_dict(choice.config)) == ("gluon", ring)


def test_the_benches_write_their_cells_after_each_item_and_propose_entries_at_the_end(tmp_path, monkeypatch, capsys):
    """gpu_timing.run_cells (the W4A16 benches' loop): the JSON holds the finished items' cells after each item (a
    run cut by its time limit keeps them, ``complete`` false), then ``complete`` and the proposed entries, logged."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from gpu_timing import run_cells

    out = tmp_path / "run.json"
    seen = []

    def run_item(item):
        if seen:  # the previous item's cells are on disk before this one runs
            assert json.loads(out.read_text()) == {"card": "c", "cells": seen[-1:], "complete": False}
        seen.append({"item": list(item)})  # as JSON keeps it
        return [{"item": list(item)}]

    result = {"card": "c"}
    run_cells(result, str(out), [(1, 2), (3, 4)], run_item, lambda s: f"{s[0]}x{s[1]}",
              lambda cells, card: [{"n": len(cells), "card": card}])
    assert json.loads(out.read_text()) == {"card": "c", "cells": seen, "complete": True,
                                           "candidate_entries": [{"n": 2, "card": "c"}]}
    printed = capsys.readouterr().out
    assert "[1/2] 1x2" in printed and "[2/2] 3x4" in printed and '{"n": 2, "card": "c"}' in printed


def test_candidate_entries_go_into_a_table_copy_replacing_the_same_cell(tmp_path, monkeypatch):
    """bench/lib/add_table_entries.py (gpu_check.sh's w4a16-ab mode): the candidates join the table's entries, one
    for a cell and card the table already has replaces it, other cards' entries and the rest stay; the result is a
    table the selection code reads."""
    monkeypatch.syspath_prepend(str(REPO / "bench" / "lib"))
    from add_table_entries import main, table_text

    shipped = (REPO / "kernels" / "w4a16_h200.json").read_text()
    table = json.loads(shipped)
    assert table_text(table) == shipped  # written in the shipped file's layout: one entry a line
    n_before = len(table["entries"])
    h100 = "NVIDIA H100 80GB HBM3"
    old = next(e for e in table["entries"] if e.get("card") == h100 and e["m"] == 1)
    new = dict(old, config={"R": 1, "U": 4}, us=20.0)
    h200 = {"n": 5120, "k": 2048, "m": 1, "kernel": "cuda", "config": {}, "us": 6.0, "card": "NVIDIA H200",
            "source": "test"}
    (tmp_path / "decode.json").write_text(json.dumps({"candidate_entries": [new, h200]}))
    (tmp_path / "table.json").write_text(shipped)
    assert main([str(tmp_path / "decode.json"), str(tmp_path / "table.json")]) == 0
    entries = json.loads((tmp_path / "table.json").read_text())["entries"]
    assert len(entries) == n_before + 1
    same_cell = [e for e in entries if (e["n"], e["k"], e["m"], e.get("card")) == (old["n"], old["k"], 1, h100)]
    assert [e["config"] for e in same_cell] == [{"R": 1, "U": 4}]
    assert h200 in entries
    for e in entries:
        config_from_dict(e["kernel"], e["config"])
