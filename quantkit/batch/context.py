"""What every job of one model shares, computed once and kept on disk in the batch's cache folder:
calibration windows (per calibration setting), evaluation token streams, the unquantized model's
perplexity and its reference logits for KL divergence.

The base model is loaded only when something is missing from the cache, and dropped once the model's
shared inputs are complete, so a job's own model and its quantized reload are the only large things in
memory while it runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from quantkit.batch.jobs import EvalSpec, Job
from quantkit.batch.records import BASELINES_DIR, CACHE_DIR, read_record, write_json_atomic
from quantkit.config import CalibConfig, LoadConfig, resolve_device

log = logging.getLogger(__name__)


def digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]


def model_key(model: str, load: LoadConfig) -> str:
    stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in Path(model).name)[:40]
    return f"{stem}-{digest([model, asdict(load)])}"


def _save_tensor_atomic(path: Path, tensor: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(tensor, partial)
    os.replace(partial, path)


class ModelContext:
    """The shared inputs of one (model, load settings) pair, cached under ``OUT/cache/KEY/``."""

    def __init__(self, model: str, load: LoadConfig, output_dir: Path, eval_spec: EvalSpec) -> None:
        self.model, self.load, self.eval = model, load, eval_spec
        self.key = model_key(model, load)
        self.cache = Path(output_dir) / CACHE_DIR / self.key
        self.baseline_path = Path(output_dir) / BASELINES_DIR / f"{self.key}.json"
        self.device = resolve_device(load.device)
        self._loaded = None  # the base model, while needed

    # -- paths of cached items -----------------------------------------------------------------------
    def _calib_path(self, calib: CalibConfig) -> Path:
        return self.cache / f"calib-{digest(asdict(calib))}.pt"

    def _eval_path(self, source: str) -> Path:
        return self.cache / f"eval-{digest([source, self.eval.text_field])}.pt"

    def _reference_path(self) -> Path:
        spec = [self.eval.kld_source, self.eval.seqlen, self.eval.kld_max_windows, self.eval.bos]
        return self.cache / f"kld-reference-{digest(spec)}.safetensors"

    # -- the base model ------------------------------------------------------------------------------
    def _base(self):
        if self._loaded is None:
            from quantkit.models.load import load_model

            log.info("loading the unquantized model %s for calibration, baselines and KL references", self.model)
            self._loaded = load_model(self.model, self.load)
            self._loaded.model.to(self.device).eval()
        return self._loaded

    def release(self) -> None:
        self._loaded = None

    @property
    def tokenizer(self):
        if getattr(self, "_tokenizer", None) is None:
            from transformers import AutoTokenizer

            cached = self.cache / "tokenizer"
            if (cached / "tokenizer_config.json").is_file():
                self._tokenizer = AutoTokenizer.from_pretrained(cached)
            else:
                self._tokenizer = self._base().tokenizer
                self._tokenizer.save_pretrained(cached)
        return self._tokenizer

    def bos_token_id(self) -> int | None:
        """BOS id when eval windows start with it (decided once with the model's config, then cached)."""
        from quantkit.eval.perplexity import needs_bos

        path = self.cache / "bos.json"
        data = read_record(path)
        if data is None or data.get("bos") != self.eval.bos:
            wanted = (needs_bos(self.tokenizer, self._base().model.config) if self.eval.bos == "auto"
                      else self.eval.bos == "on")
            data = {"bos": self.eval.bos, "bos_token_id": self.tokenizer.bos_token_id if wanted else None}
            write_json_atomic(path, data)
        return data["bos_token_id"]

    # -- shared inputs -------------------------------------------------------------------------------
    def calibration(self, calib: CalibConfig) -> torch.Tensor:
        """Calibration windows ``[nsamples, seqlen]`` for ``calib``, drawn once."""
        path = self._calib_path(calib)
        if path.is_file():
            return torch.load(path)
        from quantkit.calibrate.tokens import calibration_tokens

        tokens = calibration_tokens(calib, self._base(), self.device)
        _save_tensor_atomic(path, tokens)
        return tokens

    def eval_tokens(self, source: str) -> torch.Tensor:
        path = self._eval_path(source)
        if path.is_file():
            return torch.load(path)
        from quantkit.eval.perplexity import load_eval_tokens

        tokens = load_eval_tokens(source, self.tokenizer, text_field=self.eval.text_field)
        _save_tensor_atomic(path, tokens)
        return tokens

    def kld_windows(self) -> torch.Tensor:
        from quantkit.eval.kld import kld_windows

        return kld_windows(self.eval_tokens(self.eval.kld_source), seqlen=self.eval.seqlen,
                           max_windows=self.eval.kld_max_windows, bos_token_id=self.bos_token_id())

    def reference(self):
        """The unquantized model's logits on the KL windows, computed once and stored."""
        from quantkit.eval.kld import StoredReference, store_reference

        path, windows = self._reference_path(), self.kld_windows()
        if path.is_file():
            try:
                return StoredReference(path, windows)
            except Exception as exc:  # a damaged or foreign file is recomputed
                log.warning("recomputing %s (%s)", path, exc)
        return store_reference(self._base().model, windows, path, device=self.device)

    def baseline(self) -> dict[str, Any]:
        """The unquantized model's perplexity on every eval set (its row in the report)."""
        data = read_record(self.baseline_path)
        spec = self._baseline_spec()
        if data is not None and data.get("spec") == spec:
            return data
        from quantkit.eval.perplexity import perplexity

        base = self._base()
        ppl = {}
        for source in self.eval.perplexity:
            result = perplexity(base.model, self.eval_tokens(source), seqlen=self.eval.seqlen,
                                max_windows=self.eval.max_windows, bos_token_id=self.bos_token_id(),
                                device=self.device)
            ppl[source] = result.ppl
        data = {"model": self.model, "key": self.key, "spec": spec, "perplexity": ppl,
                "parameters": sum(p.numel() for p in base.model.parameters())}
        write_json_atomic(self.baseline_path, data)
        return data

    def _baseline_spec(self) -> dict[str, Any]:
        return {"eval": self.eval.to_dict(), "load": asdict(self.load)}

    def prepare(self, jobs: list[Job]) -> None:
        """Everything ``jobs`` (all of this model) share, then free the base model."""
        for calib in dict.fromkeys(job.calib for job in jobs if job.needs_calibration):
            self.calibration(calib)
        for source in self.eval.perplexity:
            self.eval_tokens(source)
        self.baseline()
        if self.eval.kld:
            self.reference()
        self.release()
