"""The static-group MSE search on every SmolLM2-135M linear (the real weights, from the tests' GGUF in
~/.cache/quantkit/smollm2), one group at a time against every group at once: sym and asym g64, the defaults'
Hessian-weighted search with random positive column weights (shaped like a Hessian diagonal). Prints how
many (group, row) entries differ (must be 0) and both times on the CPU. Run with OMP_NUM_THREADS=1.

    OMP_NUM_THREADS=1 python bench/gptq_mse_batched_smollm2.py
"""

import os
import time

import torch
from transformers import AutoModelForCausalLM

from quantkit.config import QuantScheme
from quantkit.methods.gptq import GPTQConfig, _static_params_loop
from quantkit.methods.gptq_mse import static_group_qparams

p = os.path.expanduser("~/.cache/quantkit/smollm2")
m = AutoModelForCausalLM.from_pretrained(p, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32)
n = differ = total = 0
t_old = t_new = 0.0
for name, mod in m.named_modules():
    if not isinstance(mod, torch.nn.Linear) or "lm_head" in name:
        continue
    w = mod.weight.detach().float()
    g = torch.Generator().manual_seed(n)
    cw = torch.rand(w.shape[1], generator=g).pow(6) * 100 + 0.01
    cw = cw / cw.mean()
    for sym in (True, False):
        scheme = QuantScheme(4, 64, sym)
        cfg = GPTQConfig(desc_act=True, static_groups=True, mse=True, mse_weight="hessian")
        a = time.perf_counter()
        s0, z0 = _static_params_loop(w, scheme, cfg, 64, cw)
        b = time.perf_counter()
        s1, z1 = static_group_qparams(w, scheme, cfg, 64, cw)
        c = time.perf_counter()
        t_old += b - a; t_new += c - b
        differ += int(((s0 != s1) | (z0 != z1)).sum()); total += s0.numel()
    n += 1
print(f"SmolLM2-135M: {n} linears, sym+asym g64, Hessian-weighted search: {differ} of {total} (group,row) entries differ; "
      f"loop {t_old:.1f} s, batched {t_new:.1f} s (one thread, shared 2-core machine)")
