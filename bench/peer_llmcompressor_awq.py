"""The peer: llm-compressor's AWQ on SmolLM2-135M-Instruct, W4 asymmetric, groups of 64, on the CPU,
with quantkit's own calibration windows and perplexity code (protocol of ../shared/MODELS.md).

Runs in its own venv (llm-compressor pins its own transformers; torch pinned to the CPU build):
    python3 -m venv /work/venv-llmc
    /work/venv-llmc/bin/pip install torch==2.13.0 llmcompressor gguf
    /work/venv-llmc/bin/pip install --no-deps -e /work/main        # quantkit: the model loader, the perplexity
It writes the dequantized model once to $QK_PEER_FP_DIR (default /work/scratch/peer_awq/smollm2-135m-instruct-fp32)
and loads it from there: oneshot re-reads model.config.name_or_path, which for a GGUF has no config.json.
Then, from a scratch folder (llm-compressor may drop log files in the working directory):
    cd /work/scratch/peer_awq && nohup /work/venv-llmc/bin/python /work/main/bench/peer_llmcompressor_awq.py \
        > peer_awq.log 2>&1 &
About an hour on the 2 shared CPU cores. Writes bench/runs/awq_peer_llmcompressor_smollm2.json (the cited copy: bench/results/peer_llmcompressor_awq_smollm2_cpu.json).

What is shared with quantkit's runs (bench/awq_smollm2_quality.py, imported, not copied): the model loader
(quantkit.models.load_model: the Q4_1 GGUF dequantized to fp32), the calibration sampler (128 windows of
512 tokens at random offsets, seed 0, of valid.tokens.txt) and the perplexity function `ppl` (WikiText-2
raw test, lines joined with blank lines, tokenized once without special tokens, non-overlapping windows
of 2048, first 40, fp32) that produced quantkit's numbers. quantkit.eval.perplexity scores the same model
a second time as a cross-check. The number of torch threads is the quality script's (QK_THREADS, default 1).

The recipe: llm-compressor's AWQModifier (defaults: duo scaling, 20 grid points, the Llama mappings it
infers) followed by a QuantizationModifier whose scheme is the W4A16_ASYM preset with group_size 64
instead of 128 (llm-compressor refuses 128 here: 576 % 128 != 0), targets Linear, lm_head ignored (the
embeddings are not a Linear). After oneshot the model is evaluated as llm-compressor leaves it: fp32
weights (AWQ-scaled) that each Linear's forward fake-quantizes with the frozen scale and zero point.
The script checks that this is so (distinct values per group of the effective weights <= 16, a Linear's
output equals x @ Q(W)^T) and records the check.

Patch (CPU only): llm-compressor's AWQ pins its cached activations (IntermediatesCache.pin_memory) without
asking whether an accelerator exists, and torch without one raises "Cannot access accelerator device when
none is available". The script replaces that method by a no-op when torch sees no accelerator; pinning
only speeds host-to-device copies, which a CPU run does not make.

Env (for smoke tests only; the defaults are the protocol): QK_NCALIB (calibration windows, 128),
QK_NWIN (perplexity windows, 40), QK_LAYERS (keep the first N decoder layers), QK_PEER_BATCH (calibration
batch size, 16, as quantkit's walk), QK_PEER_FP (also score the unquantized model, 1), QK_PEER_XCHECK
(also score with quantkit.eval.perplexity, 1), QK_PEER_OUT (output path).
"""
# ruff: noqa: E402  (--help answers before the peer's own packages, absent from quantkit's venv, are imported)
import argparse
import sys

if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

import datetime
import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import resource
import subprocess
import threading
import time

import torch
import torch.nn.functional as F
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQModifier
from llmcompressor.pipelines.cache import IntermediatesCache
from loguru import logger

from quantkit.config import LoadConfig
from quantkit.eval.perplexity import perplexity as quantkit_perplexity
from quantkit.models.load import load_model

_BENCH = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_BENCH)
sys.path.insert(0, _BENCH)
# quantkit's AWQ quality script: its GGUF path, data folder, calibration sampler, perplexity function and
# thread setting (importing it sets torch's thread count from QK_THREADS, default 1).
qk = importlib.import_module("awq_smollm2_quality")

OUT = os.environ.get("QK_PEER_OUT", os.path.join(_BENCH, "runs", "awq_peer_llmcompressor_smollm2.json"))
NCALIB = int(os.environ.get("QK_NCALIB", "128"))
BATCH = int(os.environ.get("QK_PEER_BATCH", "16"))
FP_DIR = os.environ.get("QK_PEER_FP_DIR", "/work/scratch/peer_awq/smollm2-135m-instruct-fp32")
DO_FP = os.environ.get("QK_PEER_FP", "1") == "1"
DO_XCHECK = os.environ.get("QK_PEER_XCHECK", "1") == "1"
GROUP = 64

# quantkit's numbers on the same protocol (bench/runs/awq_smollm2_quality.json, ../shared/MODELS.md).
QUANTKIT = {"fp": 19.86, "rtn_asym_g64": 26.45, "awq_asym_g64 (awq_asym_g64_tied_s8)": 22.9955}
# The same inputs under quantkit's venv (transformers 5.24): sha256 of the calibration windows [128, 512]
# (int64), of the test token ids [309196] and of the loaded fp32 state dict (names and bytes, sorted).
REFERENCE_SHA256 = {
    "calibration": "bd3f3667f6a504b4cf6c8614f667b8436f2628a26b94d42793d6d75e6dda288c",
    "test_tokens": "82416ff156b51e29d3744ed1bac8d6f0f66f99608bdba8f20fc6970de280522c",
    "fp_state_dict": "3c5fdee91060c09a103a3ace048e09657659253dda455eaa5b13bcd2d5525f3b",
}


def sha256_tensor(t):
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def sha256_state(model):
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode()); h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def patch_pin_memory():
    """No-op IntermediatesCache.pin_memory on a torch without accelerator (see the docstring)."""
    if torch.accelerator.is_available():
        return None

    def pin_memory(self, batch_index, input_names=None):
        return None

    IntermediatesCache.pin_memory = pin_memory
    return ("llmcompressor.pipelines.cache.IntermediatesCache.pin_memory replaced by a no-op (monkeypatch in this "
            "script, site-packages untouched): AWQ calls it unconditionally and a CPU-only torch raises "
            "'Cannot access accelerator device when none is available'")


def recipe():
    preset = preset_name_to_scheme("W4A16_ASYM", ["Linear"])  # group_size 128
    weights = QuantizationArgs(**{**preset.weights.model_dump(), "group_size": GROUP})
    scheme = QuantizationScheme(**{**preset.model_dump(), "weights": weights})
    return [AWQModifier(duo_scaling=True, n_grid=20),
            QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])]


def describe(modifiers):
    out = []
    for m in modifiers:
        try:
            fields = m.model_dump(mode="json", exclude_none=True)
        except Exception:  # noqa: BLE001 - a field that does not serialize: keep its repr
            fields = repr(m)
        out.append({"modifier": f"{type(m).__module__}.{type(m).__name__}", "fields": fields})
    return out


class LoadSampler:
    """Samples the 1-minute load average every `period` seconds while the quantization runs."""

    def __init__(self, period=30.0):
        self.period, self.samples, self._stop = period, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.period):
            self.samples.append(round(os.getloadavg()[0], 2))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set(); self._thread.join()

    def summary(self):
        s = self.samples
        return {"period_s": self.period, "n": len(s), "mean": sum(s) / len(s) if s else None,
                "min": min(s) if s else None, "max": max(s) if s else None}


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"user": r.ru_utime, "system": r.ru_stime}


@torch.no_grad()
def quantized_weight_check(model):
    """Per quantized Linear: distinct values per group of 64 of the weight the forward uses (Q(W), from
    llm-compressor's forward_quantize with the module's frozen scale / zero point) and of the stored W;
    and that the module's output is x @ Q(W)^T (+ bias), not x @ W^T."""
    gen = torch.Generator().manual_seed(0)
    layers, worst_q, worst_raw, out_err, fp_gap, statuses = 0, 0, 0, 0.0, 0.0, set()
    unquantized_linears = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            unquantized_linears.append(name)
            continue
        layers += 1
        statuses.add(str(getattr(module, "quantization_status", None)))
        w = module.weight.data
        wq = forward_quantize(module, w, "weight", scheme.weights)
        for t, key in ((wq, "q"), (w, "raw")):
            g = t.reshape(t.shape[0], -1, GROUP).sort(dim=-1).values
            distinct = int((1 + (g[..., 1:] != g[..., :-1]).sum(-1)).max())
            if key == "q":
                worst_q = max(worst_q, distinct)
            else:
                worst_raw = max(worst_raw, distinct)
        x = torch.randn(4, w.shape[1], generator=gen)
        y = module(x)
        ref = F.linear(x, wq, module.bias)
        out_err = max(out_err, ((y - ref).abs().max() / ref.abs().max()).item())
        fp_gap = max(fp_gap, ((y - F.linear(x, w, module.bias)).abs().max() / ref.abs().max()).item())
    return {
        "quantized_linears": layers,
        "group_size": GROUP,
        "max_distinct_values_per_group_effective_weight": worst_q,
        "max_distinct_values_per_group_stored_weight": worst_raw,
        "max_rel_error_module_output_vs_x_QW": out_err,
        "max_rel_gap_module_output_vs_x_W_unquantized": fp_gap,
        "quantization_status": sorted(statuses),
        "unquantized_linears": unquantized_linears,
        "embedding_quantized": hasattr(model.get_input_embeddings(), "quantization_scheme"),
        "passed": layers > 0 and worst_q <= 16 and out_err < 1e-5 and unquantized_linears == ["lm_head"],
    }


def fp_model():
    """The dequantized GGUF as an ordinary transformers folder (oneshot re-reads the config from
    model.config.name_or_path, and a GGUF folder has no config.json), written once beside the scratch
    run, then loaded from there by quantkit's loader; its state dict is checked against the GGUF's."""
    if not os.path.exists(os.path.join(FP_DIR, "config.json")):
        lm = load_model(qk.GGUF, LoadConfig(dtype="float32", device="cpu"))  # quantizer marks cleared
        lm.model.save_pretrained(FP_DIR)
        lm.tokenizer.save_pretrained(FP_DIR)
    lm = load_model(FP_DIR, LoadConfig(dtype="float32", device="cpu"))
    return lm.model, lm.tokenizer


def git_commit():
    try:
        return subprocess.run(["git", "-C", _REPO, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main():
    started = time.time()
    messages = []  # llm-compressor's warnings and errors, and the AWQ debug lines that say what it did
    keep = ("AWQ grid search for", "Error reduction statistics", "Skipping")
    logger.add(lambda m: messages.append(m.record["message"])
               if m.record["level"].name in ("WARNING", "ERROR") or m.record["message"].startswith(keep) else None,
               level="DEBUG")
    patch = patch_pin_memory()
    torch.manual_seed(0)
    model, tok = fp_model()
    state_sha = sha256_state(model)
    if qk.LAYERS:
        model.model.layers = model.model.layers[: qk.LAYERS]
        model.config.num_hidden_layers = qk.LAYERS
    calib = qk.calibration(tok)  # [128, 512], quantkit's sampler (seed 0)
    test_ids = qk.tokens_of_txt(tok, f"{qk.DATA}/test.raw.txt")
    hashes = {"calibration": sha256_tensor(calib), "test_tokens": sha256_tensor(test_ids),
              "fp_state_dict": state_sha}
    calib = calib[:NCALIB]
    rec = {
        "what": "llm-compressor AWQ (AWQModifier + QuantizationModifier, W4A16_ASYM with group_size 64) on "
                "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized, fp32), CPU; WikiText-2 test perplexity, "
                "seqlen 2048, first 40 windows, no BOS; calibration 128 x 512 tokens at random offsets (seed 0) "
                "of valid.tokens.txt; lm_head and embeddings unquantized",
        "model": {"gguf": qk.GGUF, "loaded_from": FP_DIR,
                  "how": "quantkit.models.load_model(gguf) -> save_pretrained -> load_model(folder); state dict "
                         "sha256 compared with the GGUF load in quantkit's venv (inputs_match_quantkit_venv)"},
        "protocol": {"calibration_windows": int(calib.shape[0]), "calibration_seqlen": int(calib.shape[1]),
                     "calibration_seed": 0, "calibration_batch_size": BATCH, "ppl_seqlen": 2048,
                     "ppl_windows": qk.NWIN, "dtype": "float32", "layers_kept": qk.LAYERS or None,
                     "calibration_sampler": "bench/smollm2_protocol.py:calibration",
                     "perplexity_function": "bench/smollm2_protocol.py:ppl",
                     "cross_check": "quantkit.eval.perplexity.perplexity" if DO_XCHECK else None},
        "inputs_sha256": hashes,
        "inputs_match_quantkit_venv": {k: hashes[k] == REFERENCE_SHA256[k] for k in hashes},
        "quantkit_reference_ppl": QUANTKIT,
        "threads": torch.get_num_threads(),
        "cpu": {"cores": os.cpu_count(), "machine": platform.machine(), "processor": platform.processor(),
                "note": "2 cores shared with other engineers' jobs: read the wall time with the load averages "
                        "and the CPU seconds"},
        "patches": [patch] if patch else [],
    }
    if DO_FP:
        t0 = time.perf_counter()
        rec["fp_ppl"] = qk.ppl(model, test_ids, nwin=qk.NWIN)
        rec["fp_ppl_seconds"] = time.perf_counter() - t0
        print(f"fp ppl {rec['fp_ppl']:.4f} ({rec['fp_ppl_seconds']:.0f} s)", flush=True)

    ds = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    modifiers = recipe()
    rec["recipe"] = describe(modifiers)
    rec["oneshot_kwargs"] = {"num_calibration_samples": int(calib.shape[0]), "max_seq_length": int(calib.shape[1]),
                             "batch_size": BATCH, "shuffle_calibration_samples": False,
                             "pipeline": "default (independent -> sequential for AWQ)"}
    rec["loadavg_before_oneshot"] = os.getloadavg()
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    with LoadSampler() as load:
        model = oneshot(model=model, processor=tok, dataset=ds, recipe=modifiers,
                        num_calibration_samples=int(calib.shape[0]), max_seq_length=int(calib.shape[1]),
                        batch_size=BATCH, shuffle_calibration_samples=False)
    rec["oneshot_wall_seconds"] = time.perf_counter() - t0
    cpu1 = cpu_seconds()
    rec["loadavg_after_oneshot"] = os.getloadavg()
    rec["loadavg_1min_during_oneshot"] = load.summary()
    rec["oneshot_cpu_seconds"] = {k: cpu1[k] - cpu0[k] for k in cpu0}
    rec["oneshot_cpu_seconds"]["total"] = sum(rec["oneshot_cpu_seconds"].values())
    rec["awq_mappings_smoothed"] = sum(m.startswith("AWQ grid search for") for m in messages)
    rec["awq_mappings_skipped"] = [m for m in messages if m.startswith("Skipping")]
    rec["llmcompressor_messages"] = {}  # message -> how many times
    for m in messages:
        if not m.startswith(("AWQ grid search for", "Skipping")):
            rec["llmcompressor_messages"][m] = rec["llmcompressor_messages"].get(m, 0) + 1
    print(f"oneshot {rec['oneshot_wall_seconds']:.0f} s wall, {rec['oneshot_cpu_seconds']['total']:.0f} s CPU, "
          f"{rec['awq_mappings_smoothed']} mappings smoothed", flush=True)

    model.eval()
    rec["quantized_weight_check"] = quantized_weight_check(model)
    print(json.dumps(rec["quantized_weight_check"]), flush=True)
    t0 = time.perf_counter()
    rec["ppl"] = qk.ppl(model, test_ids, nwin=qk.NWIN)
    rec["ppl_seconds"] = time.perf_counter() - t0
    print(f"ppl {rec['ppl']:.4f} ({rec['ppl_seconds']:.0f} s)", flush=True)
    if DO_XCHECK:
        res = quantkit_perplexity(model, test_ids, seqlen=2048, max_windows=qk.NWIN)
        rec["ppl_quantkit_eval"] = res.ppl
        rec["ppl_quantkit_eval_windows"] = res.n_windows
        print(f"ppl (quantkit.eval.perplexity) {res.ppl:.4f}", flush=True)

    rec["versions"] = {p: importlib.metadata.version(p) for p in
                       ("llmcompressor", "compressed-tensors", "torch", "transformers", "datasets", "gguf")}
    rec["versions"]["python"] = platform.python_version()
    rec["quantkit_commit"] = git_commit()
    rec["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    rec["total_script_seconds"] = time.time() - started
    rec["command"] = "cd /work/scratch/peer_awq && /work/venv-llmc/bin/python /work/main/bench/peer_llmcompressor_awq.py"
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(rec, f, indent=1, default=str)
    print(f"wrote {OUT}", flush=True)


if __name__ == "__main__":
    main()
