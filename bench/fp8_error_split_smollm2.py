"""Where FP8's perplexity cost on SmolLM2-135M comes from: the weight rounding, the per-token activation
rounding, the 16-bit storage of the other tensors, each alone and together, on ../shared/MODELS.md's
protocol (bench/smollm2_protocol.py), with the relative error of every linear's rounding beside the floor
that e4m3's 3-bit mantissa sets for Gaussian data.

The roundings are the checkpoint's (``quantkit.primitives``: per-output-channel weight scales, per-token
activation scales, ``absmax / 448``, round to nearest even), applied in float32 to the fp32 GGUF model: the
weights in place, the activations by a hook on each linear's input. lm_head stays unquantized, as in
``quantkit fp8``'s default. The relative errors are measured on the first calibration window.

Usage: OMP_NUM_THREADS=1 python bench/fp8_error_split_smollm2.py [--windows 4] [--out FILE]
"""
import argparse
import json
import os
import platform
import time

import torch
from smollm2_protocol import GGUF, load_protocol, ppl  # bench/, beside this script

from quantkit.primitives import dequantize_fp8, fp8_scale, quantize_fp8


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` through e4m3 with one scale per row (a weight's output channel, an activation's token)."""
    s = fp8_scale(x.float().abs().amax(-1, keepdim=True))
    return dequantize_fp8(quantize_fp8(x, s), s).to(x.dtype)


def rel_error(x: torch.Tensor) -> float:
    x = x.float()
    return ((round_rows(x) - x).norm() / x.norm()).item()


def summary(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"min": v[0], "median": v[len(v) // 2], "max": v[-1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "fp8_error_split_smollm2.json"))
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("QK_THREADS", "1")))
    started = time.time()
    model, _, fp_state, test_ids, calib = load_protocol()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}

    act_err: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: act_err.__setitem__(n, rel_error(a[0])))
             for n, m in linears.items()]
    with torch.inference_mode():
        model(input_ids=calib[:1], use_cache=False)
    for h in hooks:
        h.remove()
    weight_err = {n: rel_error(m.weight) for n, m in linears.items()}
    gaussian = rel_error(torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)))

    def run(weights: bool, activations: bool, other_bf16: bool) -> float:
        model.load_state_dict(fp_state)
        linear_weights = {id(m.weight) for m in linears.values()}
        with torch.no_grad():
            for p in model.parameters():
                if id(p) in linear_weights and weights:
                    p.copy_(round_rows(p))
                elif id(p) not in linear_weights and other_bf16:
                    p.copy_(p.to(torch.bfloat16).float())
        hooks = [m.register_forward_pre_hook(lambda mod, a: (round_rows(a[0]),)) for m in linears.values()] \
            if activations else []
        try:
            return ppl(model, test_ids, nwin=args.windows)
        finally:
            for h in hooks:
                h.remove()

    rows = [("fp32 (GGUF)", False, False, False), ("other tensors bfloat16", False, False, True),
            ("weights e4m3 (W8A16)", True, False, False), ("activations e4m3 per token", False, True, False),
            ("W8A8 (as `quantkit fp8` writes it)", True, True, True)]
    results = []
    for name, w, a, b in rows:
        p = run(w, a, b)
        results.append({"row": name, "ppl": p})
        base = results[0]["ppl"]
        print(f"{name:36s} ppl {p:8.4f}  {100 * (p / base - 1):+6.2f}%", flush=True)
    record = {
        "model": os.path.basename(GGUF), "windows": args.windows, "seqlen": 2048,
        "rows": [dict(r, rel_change=r["ppl"] / results[0]["ppl"] - 1) for r in results],
        "linear_input_rel_error": summary(list(act_err.values())),
        "linear_weight_rel_error": summary(list(weight_err.values())),
        "gaussian_rel_error_per_row": gaussian,
        "n_linears": len(linears), "seconds": time.time() - started, "torch": torch.__version__,
        "python": platform.python_version(), "card": "cpu", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(f"relative error of the e4m3 rounding, per linear: inputs {record['linear_input_rel_error']}, "
          f"weights {record['linear_weight_rel_error']}; Gaussian data, one scale per row: {gaussian:.4f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
