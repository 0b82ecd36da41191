"""Tables readable when redirected; ``inspect --kernels`` in layer order, fused as the runtime runs (issue #37)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from quantkit.kernel_rows import fuse_as_runtime, natural_key


def _layer(name, out_f=64, in_f=64, bits=4):
    return (name, out_f, in_f, bits, 32, True, False)


def test_natural_order_counts_layers():
    names = [f"model.layers.{i}.mlp.down_proj" for i in (10, 2, 1, 0, 11)]
    assert [n.split(".")[2] for n in sorted(names, key=natural_key)] == ["0", "1", "2", "10", "11"]


def test_q_k_v_and_gate_up_become_the_runtimes_rows():
    layers = []
    for i in (0, 10, 2):
        for leaf, out_f in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32), ("o_proj", 64)):
            layers.append(_layer(f"model.layers.{i}.self_attn.{leaf}", out_f))
        for leaf, out_f in (("gate_proj", 128), ("up_proj", 128)):
            layers.append(_layer(f"model.layers.{i}.mlp.{leaf}", out_f))
        layers.append(_layer(f"model.layers.{i}.mlp.down_proj", 64, 128))
    rows = fuse_as_runtime(layers)
    assert [r[0] for r in rows[:4]] == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_up_proj",
                                        "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.qkv_proj"]
    assert [r[0].split(".")[2] for r in rows] == ["0"] * 4 + ["2"] * 4 + ["10"] * 4
    qkv = {r[0]: r for r in rows}["model.layers.2.self_attn.qkv_proj"]
    assert qkv[1:3] == (128, 64)  # 64 + 32 + 32 outputs, one input
    assert {r[0]: r for r in rows}["model.layers.0.mlp.gate_up_proj"][1] == 256


def test_groups_the_runtime_keeps_apart_stay_apart():
    attn = [_layer(f"model.layers.0.self_attn.{leaf}") for leaf in ("q_proj", "k_proj", "v_proj")]
    assert len(fuse_as_runtime(attn, same_g_idx=lambda names: False)) == 3  # act-order g_idx differ
    three_bit = [_layer(f"model.layers.0.self_attn.{leaf}", bits=3) for leaf in ("q_proj", "k_proj", "v_proj")]
    assert len(fuse_as_runtime(three_bit)) == 3  # 3-bit words do not concatenate
    partial = attn[:2]  # no v_proj quantized: nothing to fuse
    assert [r[0] for r in fuse_as_runtime(partial)] == ["model.layers.0.self_attn.k_proj",
                                                       "model.layers.0.self_attn.q_proj"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_llama_dir, tmp_path_factory):
    from quantkit import api
    from quantkit.config import QuantScheme

    out = tmp_path_factory.mktemp("ckpt") / "rtn"
    api.quantize(str(tiny_llama_dir), out, method="rtn", scheme=QuantScheme(4, 32, True), progress=False)
    return out


def _invoke(args):
    from quantkit.cli.app import app

    env = {"COLUMNS": None, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = CliRunner().invoke(app, [str(a) for a in args], env=env)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_inspect_kernels_redirected_keeps_whole_names_in_layer_order(tiny_checkpoint):
    out = _invoke(["inspect", tiny_checkpoint, "--kernels"])
    assert "…" not in out
    names = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│ model.layers.")]
    assert "model.layers.0.self_attn.qkv_proj" in names and "model.layers.1.mlp.gate_up_proj" in names
    assert not {n.rsplit(".", 1)[1] for n in names} & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert names == sorted(names, key=natural_key)
    import torch

    if not torch.cuda.is_available():
        assert "the H200 (sm90) selection it would use; no GPU on this machine" in out


def test_verify_redirected_prints_whole_numbers(tiny_checkpoint):
    out = _invoke(["verify", tiny_checkpoint, "--decode-tokens", "0", "--reference", "runtime"])
    assert "…" not in out and "..." not in out.split("verify")[-1]
    table_lines = [line for line in out.splitlines() if line.startswith("│ runtime")]
    assert table_lines and all(len(line.split("│")) == 11 for line in table_lines)
