"""Which backend launcher attention's front door calls for each case of the selection, and what the
warp-specialized launcher launches, on the CPU.

``attention_varlen`` runs with the device reported as a Hopper GPU and every backend replaced by a recorder, so the
test sees which launcher each selection case reaches. The warp-specialized launcher ``attention_ws`` then runs for
real with its GPU-only steps (the kernel, TMA descriptors, SM count) replaced, which pins the kernel function
object it starts and its grid and parameters.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from quantkit.kernels import attention, attention_gluon, attention_gluon_ws

# (case, call keywords, head dim, max_seqlen_q, the backend select_attention names, the launcher that must run)
CASES = [
    ("fp8", dict(fp8=True, causal=True), 128, 512, "gluon_ws", "attention_ws"),
    ("short_causal_bf16", dict(causal=True), 128, 256, "gluon", "attention_fa3_ordered"),
    ("long_causal_bf16", dict(causal=True), 128, 512, "gluon_ws", "attention_ws"),
    ("plain_bf16_d64", dict(), 64, 128, "gluon_ws", "attention_ws"),
    ("window", dict(window_left=16), 128, 512, "triton", "triton_forward"),
    ("head_dim_96", dict(causal=True), 96, 512, "triton", "triton_forward"),
    ("explicit_gluon_ws", dict(backend="gluon_ws", causal=True), 128, 128, "gluon_ws", "attention_ws"),
    ("explicit_triton", dict(backend="triton"), 128, 512, "triton", "triton_forward"),
]


def _qkv(d, s, heads=(4, 2), batch=2):
    q = torch.zeros(batch * s, heads[0], d, dtype=torch.bfloat16)
    k = torch.zeros(batch * s, heads[1], d, dtype=torch.bfloat16)
    cu = torch.arange(0, (batch + 1) * s, s, dtype=torch.int32)
    return q, k, k.clone(), cu


def _front_door_calls(monkeypatch) -> dict[str, str]:
    """case -> the launcher the front door called."""
    seen = []
    monkeypatch.setattr(attention, "gpu_arch", lambda device: "sm90")
    monkeypatch.setattr(attention, "capability", lambda device: (9, 0))
    monkeypatch.setattr(attention, "quantize_qkv_fp8", lambda *a: "fp8 operands")
    monkeypatch.setattr(attention, "triton_forward", lambda *a: seen.append("triton_forward"))
    monkeypatch.setattr(attention_gluon, "attention_fa3_ordered", lambda *a, **kw: seen.append("attention_fa3_ordered"))
    monkeypatch.setattr(attention_gluon_ws, "attention_ws", lambda *a, **kw: seen.append("attention_ws"))
    out = {}
    for name, kw, d, s, _, _ in CASES:
        q, k, v, cu = _qkv(d, s)
        seen.clear()
        attention.attention_varlen(q, k, v, cu, cu, s, **kw)
        assert len(seen) == 1, name
        out[name] = seen[0]
    return out


def test_each_selection_case_reaches_its_launcher(monkeypatch):
    from quantkit.kernels.attention_select import AttentionCall, select_attention

    # the launchers are the functions the backend modules define
    assert attention_gluon_ws.attention_ws.__module__ == "quantkit.kernels.attention_gluon_ws"
    assert attention_gluon.attention_fa3_ordered.__module__ == "quantkit.kernels.attention_gluon"
    for name, kw, d, s, backend, _ in CASES:
        if "backend" not in kw:
            call = AttentionCall("sm90", "torch.bfloat16", "torch.bfloat16", d, kw.get("causal", False),
                                 kw.get("window_left", -1), fp8=kw.get("fp8", False), max_seqlen_q=s,
                                 max_seqlen_k=s, heads_q=4, heads_kv=2)
            assert select_attention(call)[0] == backend, name
    assert _front_door_calls(monkeypatch) == {name: launcher for name, *_, launcher in CASES}


def ws_launch_records(monkeypatch) -> list[dict]:
    """attention_ws over fp8/bf16, causal or not, head dims 64/128, default and explicit configs: the kernel it
    starts (by name), its grid and parameters."""
    calls = []

    class Kernel:
        def __init__(self, fn):
            self.name = fn.fn.__name__

        def __getitem__(self, grid):
            def run(*args, **kw):
                tensors = [list(a.shape) if isinstance(a, torch.Tensor) else a for a in args
                           if not isinstance(a, SimpleNamespace)]
                calls.append({"kernel": self.name, "grid": list(grid), "args": repr(tensors), "kw": repr(kw)})
            return run

    def descriptors(q, k, v, block_m, block_n, fp8_prepared, out):
        scales = [torch.zeros(q.shape[0], q.shape[1]), torch.zeros(k.shape[0], k.shape[1]), torch.zeros(k.shape[1])]
        return [SimpleNamespace(box=(block_m, block_n))] * 3 + (scales if fp8_prepared is not None else [out] * 3)

    monkeypatch.setattr(attention_gluon_ws, "_attn_fwd_ws", Kernel(attention_gluon_ws._attn_fwd_ws))
    monkeypatch.setattr(attention_gluon_ws, "make_descriptors", descriptors)
    monkeypatch.setattr(attention_gluon_ws, "TensorDescriptor", lambda *a: SimpleNamespace(args=a))
    monkeypatch.setattr(attention_gluon_ws, "num_sms", lambda device: 132)
    records = []
    for fp8 in (False, True):
        for causal in (False, True):
            for d in (64, 128):
                for s in (256, 1024, 9000):
                    for config in (None, (64, 3), (128, 2, False, False, True, True, True, True)):
                        q, k, v, cu = _qkv(d, s, heads=(8, 2), batch=3)
                        calls.clear()
                        attention_gluon_ws.attention_ws(q, k, v, cu, cu, s, causal=causal, config=config,
                                                        fp8_prepared="prepared" if fp8 else None)
                        assert len(calls) == 1
                        records.append({"fp8": fp8, "causal": causal, "d": d, "s": s, "config": config, **calls[0]})
    return records


def test_ws_launcher_starts_the_kernel_its_modules_define(monkeypatch):
    from quantkit.kernels import attention_gluon_ws_consumer

    assert attention_gluon_ws.attention_ws.__globals__["_attn_fwd_ws"] is attention_gluon_ws._attn_fwd_ws
    assert attention_gluon_ws._ws_consumer is attention_gluon_ws_consumer._ws_consumer
    records = ws_launch_records(monkeypatch)
    assert {r["kernel"] for r in records} == {"_attn_fwd_ws"}
    for r in records:
        if r["config"] is None:  # the defaults: persistent, one program per SM at most
            assert r["grid"][0] <= 132, r
        assert "maxnreg': 168" in r["kw"] and "CONSUMER_REGS': 240" in r["kw"], r

