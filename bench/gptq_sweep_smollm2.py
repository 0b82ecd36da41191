"""Issue 21's last item on one GPU: which GPTQ setting brings SmolLM2 asym g64 to perplexity <= 22.5.

    python bench/gptq_sweep_smollm2.py --out DIR [--budget-s 240] [--rows A1,A2,...]

In one process: loads the GGUF once (float32), draws the calibration windows exactly as the CLI does
(``calib_data.sources.load_calibration``: 128 x 512 tokens of valid.tokens.txt, seed 0 unless a row
says otherwise), and for each row restores the float32 weights, walks the model with GPTQ on the GPU
(the Triton solve kernel) and scores the in-memory model with the CLI's own perplexity code
(``quantkit.eval.perplexity``: test.raw.txt, 40 windows of 2048, float32, no TF32). The in-memory
model keeps float32 embeddings and norms where a checkpoint stores bfloat16 (worth ~0.005 on this
model, README); `bench/device_gptq_sweep.sh` runs the user's command through the CLI beside it.

Rows run in phases, in order, each appended to DIR/sweep.json as it finishes, until ``--budget-s``:
A (seed 0): the default and one change each (the mse search's column weights and norm, damping, the
shrink range); B: the best mse weighting of phase A against the default on seeds 1 and 2 (the
calibration draw's noise); C: the same pair at sym g64 and asym g128 (does it carry over?).
$QK_GGUF / $QK_DATA override the model and the text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2_protocol import DATA, GGUF  # noqa: E402

from quantkit.config import CalibConfig, LoadConfig, QuantScheme  # noqa: E402
from quantkit.methods.gptq import GPTQConfig  # noqa: E402

ASYM64 = QuantScheme(4, 64, False)
# the CLI's --asym defaults before this sweep (mse unweighted, norm 2.4); since then mse_weight="hessian"
DEFAULT = GPTQConfig(desc_act=True, static_groups=False, mse=True, mse_norm=2.4, mse_weight="none")
PHASE_A = {
    "A1_default": (ASYM64, DEFAULT, 0),
    "A2_w_residual": (ASYM64, replace(DEFAULT, mse_weight="residual", mse_norm=2.4), 0),
    "A3_w_hessian": (ASYM64, replace(DEFAULT, mse_weight="hessian", mse_norm=2.4), 0),
    "A4_w_residual_norm2": (ASYM64, replace(DEFAULT, mse_weight="residual", mse_norm=2.0), 0),
    "A5_w_hessian_norm2": (ASYM64, replace(DEFAULT, mse_weight="hessian", mse_norm=2.0), 0),
    "A6_damp0.05": (ASYM64, replace(DEFAULT, damp=0.05), 0),
    "A7_damp0.1": (ASYM64, replace(DEFAULT, damp=0.1), 0),
    "A8_shrink0.4": (ASYM64, replace(DEFAULT, mse_max_shrink=0.4), 0),
    "A9_norm2": (ASYM64, replace(DEFAULT, mse_norm=2.0), 0),
}
WEIGHTED = ("A2_w_residual", "A3_w_hessian", "A4_w_residual_norm2", "A5_w_hessian_norm2")


def later_phases(best: GPTQConfig) -> dict:
    """Phase B (seeds) and C (other grids) for the best weighted config of phase A."""
    rows = {}
    for seed in (1, 2):
        rows[f"B_default_seed{seed}"] = (ASYM64, DEFAULT, seed)
        rows[f"B_best_seed{seed}"] = (ASYM64, best, seed)
    sym_default = replace(DEFAULT, static_groups=True)  # the CLI's --sym defaults
    sym_best = replace(best, static_groups=True)
    rows["C_sym_g64_default"] = (QuantScheme(4, 64, True), sym_default, 0)
    rows["C_sym_g64_best"] = (QuantScheme(4, 64, True), sym_best, 0)
    rows["C_asym_g128_default"] = (QuantScheme(4, 128, False), DEFAULT, 0)
    rows["C_asym_g128_best"] = (QuantScheme(4, 128, False), best, 0)
    return rows


class Bench:
    """The model, its float32 weights, the test tokens, and the calibration windows per seed."""

    def __init__(self, device: str, smoke: bool = False) -> None:
        from quantkit.calib_data.sources import load_source_tokens
        from quantkit.calib_data.text import needs_bos
        from quantkit.eval.perplexity import load_eval_tokens
        from quantkit.models.load import load_model

        self.device = device
        t0 = time.perf_counter()
        loaded = load_model(GGUF, LoadConfig(dtype="float32", device="cpu"))
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.model.config.use_cache = False
        # --smoke: 2 layers, 8 x 128 calibration tokens, 2 windows of 256 (checks the script, not the model)
        self.sizes = (8, 128, 256, 2) if smoke else (128, 512, 2048, 40)
        if smoke:
            self.model.model.layers = self.model.model.layers[:2]
        self.fp_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.test_ids = load_eval_tokens(f"{DATA}/test.raw.txt", self.tokenizer)
        self.bos = self.tokenizer.bos_token_id if needs_bos(self.tokenizer, self.model.config) else None
        self.windows: dict[int, torch.Tensor] = {}
        # the CLI's calibration path for a .txt (load_calibration = load_source_tokens + sample_windows),
        # tokenized once for every seed
        self.calib_config = CalibConfig(source=f"{DATA}/valid.tokens.txt", nsamples=self.sizes[0],
                                        seqlen=self.sizes[1])
        self.calib_ids = load_source_tokens(self.calib_config, self.tokenizer)
        from quantkit.calib_data.sources import load_calibration

        same = load_calibration(replace(self.calib_config, seed=0), self.tokenizer, self.model)
        assert torch.equal(self.calibration(0), same), "the sweep's windows differ from the CLI's"
        self.load_s = time.perf_counter() - t0

    def calibration(self, seed: int) -> torch.Tensor:
        from quantkit.calib_data.sources import sample_windows

        if seed not in self.windows:
            self.windows[seed] = sample_windows(self.calib_ids, nsamples=self.sizes[0], seqlen=self.sizes[1],
                                                seed=seed, bos_token_id=self.bos)
        return self.windows[seed]

    def row(self, scheme: QuantScheme, config: GPTQConfig, seed: int) -> dict:
        from quantkit.calibrate.walker import walk
        from quantkit.eval.perplexity import perplexity
        from quantkit.methods.gptq_method import GPTQMethod

        self.model.load_state_dict(self.fp_state)
        calib = self.calibration(seed)
        t0 = time.perf_counter()
        result = walk(self.model, GPTQMethod(scheme, config), device=self.device, token_ids=calib, batch_size=8)
        quant_s = time.perf_counter() - t0
        lin = [s for layer in result.layer_stats for s in layer["linears"].values()]
        self.model.to(self.device)
        t0 = time.perf_counter()
        res = perplexity(self.model, self.test_ids, seqlen=self.sizes[2], max_windows=self.sizes[3], bos_token_id=self.bos,
                         device=self.device)
        eval_s = time.perf_counter() - t0
        self.model.to("cpu")
        return {"ppl": res.ppl, "windows": res.n_windows, "quant_s": round(quant_s, 1), "eval_s": round(eval_s, 1),
                "mean_err_gptq": sum(s["err_gptq"] for s in lin) / len(lin), "seed": seed,
                "scheme": asdict(scheme), "config": asdict(config)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no row after this many seconds")
    parser.add_argument("--row-s", type=float, default=15.0, help="expected seconds a row takes (budget check)")
    parser.add_argument("--smoke", action="store_true", help="a tiny run that checks the script")
    parser.add_argument("--rows", default="", help="comma-separated rows to run, any phase (default: the phases)")
    args = parser.parse_args()
    t_start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    record = {"what": "issue 21: GPTQ asym g64 SmolLM2, settings swept in memory (bench/gptq_sweep_smollm2.py)",
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": _device_name(device),
              "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32,
                       "precision": torch.get_float32_matmul_precision()},
              "torch": torch.__version__, "rows": {}}
    bench = Bench(device, args.smoke)
    record["load_s"] = round(bench.load_s, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "sweep.json"

    def run_rows(rows: dict) -> None:
        for name, (scheme, config, seed) in rows.items():
            elapsed = time.perf_counter() - t_start
            if elapsed + args.row_s > args.budget_s:
                record.setdefault("skipped", []).append(name)
                continue
            out = bench.row(scheme, config, seed)
            record["rows"][name] = out
            print(f"{name:<26} ppl {out['ppl']:.4f}  quant {out['quant_s']:5.1f} s  eval {out['eval_s']:4.1f} s  "
                  f"err {out['mean_err_gptq']:.5f}  t={time.perf_counter() - t_start:.0f}s", flush=True)
            path.write_text(json.dumps(record, indent=1) + "\n")

    wanted = [r for r in args.rows.split(",") if r]
    if wanted:  # exactly these rows; phases B and C with A5 (the default since) as the best
        every = {**PHASE_A, **later_phases(PHASE_A["A5_w_hessian_norm2"][1])}
        run_rows({name: every[name] for name in wanted})
    else:
        run_rows(PHASE_A)
    scored = {n: record["rows"][n]["ppl"] for n in WEIGHTED if n in record["rows"]}
    if scored and not wanted:
        best = min(scored, key=scored.get)
        record["best_weighted"] = best
        run_rows(later_phases(PHASE_A[best][1]))
    record["seconds"] = round(time.perf_counter() - t_start, 1)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


if __name__ == "__main__":
    main()
