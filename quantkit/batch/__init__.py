"""Batch quantization: many jobs (models x methods x settings) into one folder of checkpoints, result
records and a comparison report. :func:`run_batch` is the Python API; recipes (TOML/YAML) build its jobs."""

from __future__ import annotations

__all__ = ["BatchObserver", "BatchPlan", "BatchResult", "EvalSpec", "Job", "JobResult", "RecipeError",
           "load_recipe", "run_batch", "run_recipe"]

_WHERE = {
    "BatchObserver": "runner", "BatchResult": "runner", "run_batch": "runner",
    "EvalSpec": "jobs", "Job": "jobs", "JobResult": "records",
    "BatchPlan": "recipe", "RecipeError": "recipe", "load_recipe": "recipe", "run_recipe": "runner",
}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"quantkit.batch.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'quantkit.batch' has no attribute {name!r}")
