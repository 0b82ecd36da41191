"""Does AWQ's bounded search subsample cost quality? (CPU, tiny random Llama; seconds)

AWQ scores its scale search on the block outputs of the first ``search_samples`` calibration windows
(attention) and on ``search_tokens`` strided tokens of every window (token-wise blocks: the MLP, the
linears themselves), and its clip search on ``clip_tokens`` sampled tokens, while the channel means use every window: the
memory it keeps does not grow with the calibration set. This compares the subsample (default 8
windows) with searching on all windows, by the relative error of the quantized model's logits against
the full-precision model on held-out windows. Writes bench/results/awq_search_subsample_<date>.json.

    python bench/awq_search_subsample.py
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.calibrate.walker import walk
    from quantkit.config import QuantScheme
    from quantkit.methods.awq import AWQConfig
    from quantkit.methods.awq_method import AWQMethod

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # outlier input channels, as real models have: what AWQ protects
        for layer in model.model.layers:
            layer.input_layernorm.weight[torch.randperm(256)[:8]] = 8.0
    gen = torch.Generator().manual_seed(1)
    calib = torch.randint(0, 512, (32, 128), generator=gen)
    held_out = torch.randint(0, 512, (8, 128), generator=gen)
    with torch.no_grad():
        ref = model(held_out).logits.float()
    rows = []
    # (windows for attention's search, strided tokens for the token-wise searches; 0: the windows too).
    # The 8B default, 8 windows and 4096 of 262144 tokens, scores the MLP on a quarter of the windows'
    # tokens: here 8 windows and 256 of the 4096 tokens (1024 the windows' count, from every window).
    for search_samples, search_tokens in ((8, 0), (8, 256), (8, 1024), (2, 0), (0, 0)):
        q = copy.deepcopy(model)
        t0 = time.perf_counter()
        config = AWQConfig(search_samples=search_samples, search_tokens=search_tokens)
        walk(q, AWQMethod(QuantScheme(4, 64, False), config), device="cpu", token_ids=calib, batch_size=8)
        with torch.no_grad():
            out = q(held_out).logits.float()
        rows.append({"search_samples": search_samples or 32, "search_tokens": search_tokens,
                     "logit_rel_error": float((out - ref).norm() / ref.norm()), "seconds": time.perf_counter() - t0})
        print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    out_path = RESULTS / f"awq_search_subsample_{time.strftime('%Y%m%d')}.json"
    out_path.write_text(json.dumps({"rows": rows, "calib": [32, 128], "scheme": "asym g64",
                                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
