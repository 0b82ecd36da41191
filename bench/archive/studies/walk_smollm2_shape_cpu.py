"""CPU time of one GPTQ or AWQ walk at SmolLM2-135M's layer shapes (random weights; a checkout A/B).

Two decoder layers with SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 heads / 3 KV heads),
64 x 512 random calibration tokens, asym g64 (GPTQ with act-order and quantkit's default options),
one torch thread. Run it from two checkouts to compare them (the 2-core CPU here is shared: alternate
the runs and repeat). Prints the walk's seconds and appends a JSON line to bench/results/.

    QUANTKIT_ROOT=/path/to/checkout OMP_NUM_THREADS=1 python bench/walk_smollm2_shape_cpu.py gptq
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.api import build_method
    from quantkit.calibrate.walker import walk
    from quantkit.config import QuantScheme

    method = sys.argv[1] if len(sys.argv) > 1 else "gptq"
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=2048, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 2048, (64, 512), generator=torch.Generator().manual_seed(0))
    options = {"desc_act": True} if method == "gptq" else None
    quant = build_method(method, QuantScheme(4, 64, False), options)
    t0 = time.perf_counter()
    walk(model, quant, device="cpu", token_ids=ids, batch_size=8)
    seconds = time.perf_counter() - t0
    print(f"{method} walk_s {seconds:.1f}")
    out = Path(__file__).resolve().parent / "results" / "walk_smollm2_shape_cpu.jsonl"
    with out.open("a") as f:
        f.write(json.dumps({"method": method, "walk_s": seconds, "checkout": os.environ.get("QUANTKIT_ROOT"),
                            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")


if __name__ == "__main__":
    main()
