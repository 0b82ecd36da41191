"""Which MoE calibration mode gives the better model: every token through every expert, or routed only.

On random MoE models (bench/moe_models.py: skewed routers, so rarely chosen experts exist), GPTQ W4 g32
with each mode; the score is the quantized model's output against the 16-bit model's on held-out tokens
(mean KL divergence of the next-token distributions, and relative MSE of the logits). Runs on the CPU in
a few minutes; prints a table and writes bench/results/moe_calib_mode.json.

    OMP_NUM_THREADS=1 python bench/moe_calib_mode.py --seeds 3
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_models import random_moe  # noqa: E402


def score(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    logp, logq = ref.float().log_softmax(-1), out.float().log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    return kl, ((out - ref).pow(2).mean() / ref.pow(2).mean()).item()


def run(args) -> list[dict]:
    from quantkit.api import build_method
    from quantkit.calibrate.walker import walk
    from quantkit.config import QuantScheme
    from quantkit.methods.moe import MoECalibConfig
    from quantkit.methods.moe_prepare import prepare_for_quantization

    rows = []
    sizes = dict(hidden_size=args.hidden, moe_intermediate_size=args.inter, intermediate_size=2 * args.inter,
                 num_experts=args.experts, num_experts_per_tok=args.top_k, num_hidden_layers=args.layers,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4, vocab_size=512,
                 norm_topk_prob=True, max_position_embeddings=512)
    scheme = QuantScheme(bits=4, group_size=32, sym=True)
    for seed in range(args.seeds):
        base = random_moe("qwen3_moe", seed=seed, router_skew=args.skew, **sizes)
        gen = torch.Generator().manual_seed(100 + seed)
        calib = torch.randint(0, 512, (args.nsamples, args.seqlen), generator=gen)
        held = torch.randint(0, 512, (8, args.seqlen), generator=gen)
        with torch.no_grad():
            ref = base(held).logits
        for mode, floor in (("all", 8), ("routed", 8), ("routed", 0)):
            model = copy.deepcopy(base)
            method = prepare_for_quantization(model, build_method("gptq", scheme),
                                              MoECalibConfig(mode=mode, min_tokens=floor))
            res = walk(model, method, device="cpu", token_ids=calib, batch_size=4)
            with torch.no_grad():
                kl, mse = score(ref, model(held).logits)
            routed = [s["routed_tokens"] for row in res.layer_stats for n, s in row["linears"].items()
                      if n.endswith("gate_proj") and "experts" in n]
            fallback = sum(1 for row in res.layer_stats for n, s in row["linears"].items()
                           if n.endswith("gate_proj") and s.get("fallback_rtn"))
            rows.append({"seed": seed, "mode": mode, "min_tokens": floor, "kl": kl, "rel_mse": mse,
                         "min_routed": min(routed), "rtn_fallback_experts": fallback})
            print(f"seed {seed}  {mode:6s} floor {floor}: KL {kl:.5f}  rel MSE {mse:.5f}  "
                  f"fewest routed tokens {min(routed):.0f}  RTN experts {fallback}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--inter", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--skew", type=float, default=1.0, help="router row-norm spread (log-normal sigma)")
    p.add_argument("--nsamples", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=64)
    p.add_argument("--out", default="bench/results/moe_calib_mode.json")
    args = p.parse_args()
    rows = run(args)
    print("\nmode / floor      mean KL     mean rel MSE")
    summary = {}
    for key in sorted({(r["mode"], r["min_tokens"]) for r in rows}):
        sel = [r for r in rows if (r["mode"], r["min_tokens"]) == key]
        kl = sum(r["kl"] for r in sel) / len(sel)
        mse = sum(r["rel_mse"] for r in sel) / len(sel)
        summary[f"{key[0]}/floor{key[1]}"] = {"kl": kl, "rel_mse": mse}
        print(f"{key[0]:7s} floor {key[1]:<3d}  {kl:.5f}     {mse:.5f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "summary": summary,
                               "date": datetime.datetime.now(datetime.UTC).isoformat(),
                               "torch": torch.__version__, "host": platform.node(),
                               "note": "CPU, shared machine (timing not measured)"}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
