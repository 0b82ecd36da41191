"""Which launcher each row of the shipped W4A16 selection table binds, and what that launcher launches, on the CPU.

The layer's plan binds its launchers at load (``dispatch.bound_launchers``): for every (N, K, M bucket) row of the
H200 table this runs the bound launcher with the GPU-only steps replaced by recorders (the Gluon kernels, the
column gather, the TMA descriptors, the SM count), so the test sees which kernel function object would run and
with which grid and parameters. It pins that the Gluon kernels the launchers start are the ones their modules
define (``w4a16_gluon_ring``, ``w4a16_gluon_direct``) and that each row reaches the kernel its table entry names
(dequantize-then-cuBLAS entries: ``w4a16_dequant.w4a16_dequant_matmul``, recorded too).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from quantkit.kernels import dispatch, w4a16, w4a16_dequant, w4a16_gluon
from quantkit.kernels.w4a16_select import M_BUCKETS, LayerFacts, load_table, m_bucket

# the layer variants each row is bound for: the table's own (symmetric, no act order) and asymmetric act-order
# weights (the direct kernel then reads gathered activations)
VARIANTS = {"sym": (False, False), "asym_act_order": (True, True)}


def _summary(value):
    """A launch argument as comparable data: tensors by shape and dtype, descriptors by their arguments."""
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype)]
    if isinstance(value, (list, tuple)):
        return [_summary(v) for v in value]
    if isinstance(value, dict):
        return {k: _summary(v) for k, v in value.items()}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def _fake_weights(n: int, k: int, has_zeros: bool, act_order: bool, m: int) -> SimpleNamespace:
    """What the launchers read of a ``W4A16Weights`` (shapes only; nothing is computed)."""
    groups = k // 128
    return SimpleNamespace(
        out_features=n, in_features=k, group_size=128, bits=4,
        qweight=torch.empty(n, k // 8, dtype=torch.int32), scales=torch.empty(groups, n, dtype=torch.float16),
        zeros=torch.empty(groups, n, dtype=torch.uint8) if has_zeros else None,
        pair_index=torch.empty(k, dtype=torch.int32), perm=torch.arange(k) if act_order else None,
        partial_sums=torch.empty(max(M_BUCKETS[:5]) * n, dtype=torch.float32),
        tile_counters=torch.empty(n, dtype=torch.int32),
    )


def launch_records(monkeypatch) -> list[dict]:
    """For each table row and layer variant: the bound launcher's target and the launch it made (kernel name, grid,
    arguments)."""
    calls: list = []

    class Kernel:
        def __init__(self, fn):
            self.name = fn.fn.__name__

        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append({"kernel": self.name, "grid": list(grid),
                                                     "args": _summary(args), "kw": _summary(kw)})

    for name in ("_w4a16_gluon_kernel", "_w4a16_direct_kernel"):
        monkeypatch.setattr(w4a16_gluon, name, Kernel(getattr(w4a16_gluon, name)))
    monkeypatch.setattr(w4a16_gluon, "_gather_columns", lambda x, index, ws, xsum: x.clone())
    monkeypatch.setattr(w4a16_gluon, "TensorDescriptor", lambda *a: ["desc"] + _summary(list(a[1:])))
    monkeypatch.setattr(w4a16_gluon, "num_sms", lambda device: 132)
    monkeypatch.setattr(w4a16_gluon, "w4a16_gluon_matmul",
                        lambda x, w, config: calls.append({"checked_entry": repr(config)}))
    for name in ("_gemv_matmul", "_pairs_matmul", "_tc_matmul"):
        monkeypatch.setattr(w4a16, name, lambda x, w, config, name=name: calls.append({"triton": name,
                                                                                        "config": repr(config)}))
    monkeypatch.setattr(w4a16_dequant, "w4a16_dequant_matmul",
                        lambda x, w, config: calls.append({"dequant": repr(config)}))
    records = []
    for row in load_table():
        for variant, (has_zeros, act_order) in VARIANTS.items():
            facts = LayerFacts(row["n"], row["k"], 4, 128, has_zeros, act_order)
            card = row.get("card")  # an entry measured on one card: that card's plan
            plan = dispatch.plan_w4a16(facts, "sm90", card)
            launchers = dispatch.bound_launchers.__wrapped__(facts, "sm90", card)  # fresh: the recorders are bound
            index = M_BUCKETS.index(m_bucket(row["m"]))
            choice = plan.choices[index][1]
            x = torch.empty(row["m"], row["k"], dtype=torch.bfloat16)
            calls.clear()
            launchers[index](x, _fake_weights(row["n"], row["k"], has_zeros, act_order, row["m"]))
            assert len(calls) == 1
            records.append({"row": [row["n"], row["k"], row["m"]], "variant": variant, "table": row["kernel"],
                            "table_config": repr(row["config"]), "chosen": repr(choice.config), **calls[0]})
    return records


def test_every_table_row_binds_the_kernel_its_entry_names(monkeypatch):
    from quantkit.kernels import w4a16_gluon_direct, w4a16_gluon_ring

    # the launchers start the kernel objects their modules define (jit globals resolve there)
    assert w4a16_gluon._w4a16_gluon_kernel is w4a16_gluon_ring._w4a16_gluon_kernel
    assert w4a16_gluon._w4a16_direct_kernel is w4a16_gluon_direct._w4a16_direct_kernel
    assert w4a16_gluon.launch.__module__ == "quantkit.kernels.w4a16_gluon"
    records = launch_records(monkeypatch)
    assert len(records) == len(load_table()) * len(VARIANTS)
    for r in records:
        if r["variant"] == "sym":  # the table's own layers get the table's entry
            assert r["chosen"] == r["table_config"], r
        if r["table"] == "cuda":  # no CUDA build off the GPU: the launcher runs its fallback, the Gluon pick
            assert r.get("kernel") in ("_w4a16_direct_kernel", "_w4a16_gluon_kernel"), r
        elif r["table"] == "gemv":
            assert r.get("triton") == "_gemv_matmul", r
        elif r["table"] == "dequant":  # dequantize-then-cuBLAS, with the entry's config
            assert r.get("dequant") == r["table_config"], r
        elif "DIRECT=True" in r["chosen"]:
            assert r.get("kernel") == "_w4a16_direct_kernel", r
            # act order (or GATHER_X): the gather, then the kernel on gathered columns
            gathered = r["variant"] == "asym_act_order" or "GATHER_X=True" in r["chosen"]
            assert r["kw"]["GATHERED"] is gathered, r
        else:
            assert r.get("kernel") == "_w4a16_gluon_kernel", r
            assert r["kw"]["launch_pdl"] is True and r["kw"]["HAS_ZEROS"] is (r["variant"] != "sym"), r


@pytest.mark.parametrize("m", [1, 3, 16])
def test_launch_sends_direct_configs_to_the_direct_kernel(monkeypatch, m):
    direct = next(e["config"] for e in load_table() if getattr(e["config"], "DIRECT", False))
    seen = []
    monkeypatch.setattr(w4a16_gluon, "_launch_direct", lambda x, w, config: seen.append(config))
    w4a16_gluon.launch(torch.empty(m, 256, dtype=torch.bfloat16), _fake_weights(128, 256, False, False, m), direct)
    assert seen == [direct]
