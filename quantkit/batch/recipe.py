"""A recipe file into a validated :class:`BatchPlan`, with every problem reported at once.

Layout (TOML shown; YAML has the same keys)::

    output = "runs/smollm2"          # where checkpoints, records and the report go
    [models]                         # short names (they prefix job names) for model paths or hub ids
    smollm2 = "${SMOLLM2_GGUF:-/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf}"
    [defaults]                       # any job field, for every job
    model = "smollm2"
    [eval]                           # EvalSpec fields
    perplexity = ["../shared/data/wikitext2/test.raw.txt"]
    [[grid]]                         # lists are axes: one job per combination
    method = ["rtn", "gptq"]
    group_size = [128, 32]
    [[jobs]]                         # single jobs
    method = "awq"
    bits = 3

String values may name environment variables: ``${VAR}`` or ``${VAR:-default}``.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.batch.jobs import EvalSpec, Job, default_job_name
from quantkit.batch.source import expand_env, read_recipe_file
from quantkit.config import CalibConfig, LoadConfig, QuantkitError, QuantScheme
from quantkit.eval.perplexity import EVAL_SOURCES

TOP_LEVEL = ("output", "models", "defaults", "eval", "grid", "jobs")
# Job fields that are not method options, with their type.
JOB_FIELDS: dict[str, type | tuple] = {
    "name": str, "model": str, "method": str, "bits": int, "group_size": int, "sym": bool,
    "calib": str, "nsamples": int, "seqlen": int, "seed": int, "text_field": str,
    "device": str, "dtype": str, "trust_remote_code": bool, "batch_size": int, "quantize_lm_head": bool,
}
EVAL_FIELDS: dict[str, type | tuple] = {
    "perplexity": list, "seqlen": int, "max_windows": int, "kld": bool, "kld_data": str,
    "kld_max_windows": int, "bos": str, "text_field": str,
}
_CONFIG_OF = {"bits": QuantScheme, "group_size": QuantScheme, "sym": QuantScheme,
              "calib": CalibConfig, "nsamples": CalibConfig, "seqlen": CalibConfig, "seed": CalibConfig,
              "text_field": CalibConfig, "dtype": LoadConfig, "device": LoadConfig, "trust_remote_code": LoadConfig}


class RecipeError(QuantkitError):
    """A recipe with problems; ``problems`` lists each one (job, field, line)."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"recipe {path} has {len(problems)} problem(s); nothing was run:\n  - "
                         + "\n  - ".join(problems))


@dataclass(frozen=True)
class BatchPlan:
    """A validated recipe: the jobs in order, how they are measured, where results go."""

    jobs: tuple[Job, ...]
    eval: EvalSpec
    output: Path
    recipe: Path | None = None


@dataclass
class _Value:
    value: Any
    where: str  # "defaults", "grid[1]", "jobs[0]"
    line: int | None


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, where: str, field: str | None, message: str, line: int | None) -> None:
        text = where + (f", field {field!r}" if field else "") + (f" (line {line})" if line else "") + f": {message}"
        if text not in self.items:
            self.items.append(text)


def method_options() -> dict[str, dict[str, Any]]:
    """Option names (and defaults) each method takes, from its config record; ``format`` for all."""
    from quantkit.methods.awq import AWQConfig
    from quantkit.methods.fp8 import FP8Config
    from quantkit.methods.gptq import GPTQConfig

    def fields(cls) -> dict[str, Any]:
        return {f.name: f.default for f in dataclasses.fields(cls)}

    return {"rtn": {"format": "gptq"}, "gptq": {**fields(GPTQConfig), "format": "gptq"},
            "awq": {**fields(AWQConfig), "format": "gptq"}, "fp8": fields(FP8Config)}


def load_recipe(path: str | Path, *, output: str | Path | None = None) -> BatchPlan:
    """Parse and validate ``path``; raise :class:`RecipeError` naming every problem."""
    path = Path(path).expanduser()
    data, lines = read_recipe_file(path)
    problems = _Problems()
    options = method_options()
    for key in data:
        if key not in TOP_LEVEL:
            problems.add("recipe", key, f"unknown top-level key; use {', '.join(TOP_LEVEL)}", lines.get((key,)))
    models = _models(data.get("models", {}), lines, problems)
    known = set(JOB_FIELDS) | {name for names in options.values() for name in names}
    defaults = _table(data.get("defaults", {}), "defaults", ("defaults",), lines, known, problems)
    entries = _expand(data, lines, known, problems)
    eval_spec = _eval_spec(data.get("eval", {}), lines, problems)
    jobs = []
    for where, values in entries:
        job = _job({**defaults, **values}, where, models, options, problems)
        if job is not None:
            jobs.append(job)
    _check_unique(jobs, problems)
    if not entries and not problems.items:
        problems.add("recipe", None, "no jobs: add a [[jobs]] entry or a [grid]", None)
    out = output if output is not None else data.get("output")
    if out is None:
        problems.add("recipe", "output", "no output folder: set output = \"...\" or pass --output", None)
    elif not isinstance(out, (str, Path)):
        problems.add("recipe", "output", "must be a path string", lines.get(("output",)))
    if problems.items:
        raise RecipeError(path, problems.items)
    return BatchPlan(jobs=tuple(jobs), eval=eval_spec, output=Path(_env(str(out))).expanduser(), recipe=path)


def recipe_output(path: str | Path) -> Path:
    """The output folder a recipe names (without validating its jobs)."""
    data, _ = read_recipe_file(path)
    if not isinstance(data.get("output"), str):
        raise QuantkitError(f"recipe {path} names no output folder; pass the folder itself")
    return Path(_env(data["output"])).expanduser()


def _env(value: str) -> str:
    try:
        return expand_env(value)
    except KeyError as exc:
        raise QuantkitError(f"environment variable {exc.args[0]} is not set (use ${{VAR:-default}})") from None


def _models(table: Any, lines: dict, problems: _Problems) -> dict[str, str]:
    if not isinstance(table, dict):
        problems.add("models", None, "must be a table of name = model path or hub id", lines.get(("models",)))
        return {}
    models = {}
    for name, spec in table.items():
        if not isinstance(spec, str):
            problems.add("models", name, "must be a model path or hub id string", lines.get(("models", name)))
            continue
        try:
            models[name] = _env(spec)
        except QuantkitError as exc:
            problems.add("models", name, str(exc), lines.get(("models", name)))
    return models


def _table(table: Any, where: str, key: tuple, lines: dict, known: set, problems: _Problems) -> dict[str, _Value]:
    if not isinstance(table, dict):
        problems.add(where, None, "must be a table of job fields", lines.get(key))
        return {}
    out = {}
    for name, value in table.items():
        line = lines.get((*key, name))
        if name not in known:
            problems.add(where, name, "unknown field; job fields are " + ", ".join(JOB_FIELDS)
                         + " and the methods' options", line)
            continue
        out[name] = _Value(value, where, line)
    return out


def _expand(data: dict, lines: dict, known: set, problems: _Problems) -> list[tuple[str, dict[str, _Value]]]:
    """(where, fields) of every job: grid combinations first, then single jobs."""
    entries: list[tuple[str, dict[str, _Value]]] = []
    grids = data.get("grid", [])
    grids = [grids] if isinstance(grids, dict) else grids
    for index, grid in enumerate(grids if isinstance(grids, list) else []):
        key = ("grid", index) if isinstance(data.get("grid"), list) else ("grid",)
        table = _table(grid, f"grid[{index}]", key, lines, known, problems)
        axes = {name: v for name, v in table.items() if isinstance(v.value, list)}
        for name, axis in axes.items():
            if not axis.value:
                problems.add(axis.where, name, "an empty list makes no jobs: give at least one value", axis.line)
        for combo in itertools.product(*(v.value for v in axes.values())):
            fields = {**table, **{name: _Value(value, table[name].where, table[name].line)
                                  for name, value in zip(axes, combo)}}
            entries.append((f"grid[{index}]", fields))
    jobs = data.get("jobs", [])
    if not isinstance(jobs, list):
        problems.add("jobs", None, "must be a list of tables ([[jobs]])", lines.get(("jobs",)))
        jobs = []
    for index, job in enumerate(jobs):
        entries.append((f"jobs[{index}]", _table(job, f"jobs[{index}]", ("jobs", index), lines, known, problems)))
    return entries


def _eval_spec(table: Any, lines: dict, problems: _Problems) -> EvalSpec:
    if not isinstance(table, dict):
        problems.add("eval", None, "must be a table", lines.get(("eval",)))
        return EvalSpec(kld=False)
    kwargs = {}
    for name, value in table.items():
        line = lines.get(("eval", name))
        if name not in EVAL_FIELDS:
            problems.add("eval", name, f"unknown field; use {', '.join(EVAL_FIELDS)}", line)
        elif not _type_ok(value, EVAL_FIELDS[name]) or (name == "perplexity" and
                                                         not all(isinstance(v, str) for v in value)):
            problems.add("eval", name, f"expected {_type_name(EVAL_FIELDS[name])}, got {value!r}", line)
        else:
            try:
                kwargs[name] = [_env(v) for v in value] if name == "perplexity" else (
                    _env(value) if isinstance(value, str) else value)
            except QuantkitError as exc:
                problems.add("eval", name, str(exc), line)
    sources = [("perplexity", s) for s in kwargs.get("perplexity", [])]
    sources += [("kld_data", kwargs["kld_data"])] if "kld_data" in kwargs else []
    for name, source in sources:
        if source not in EVAL_SOURCES and not Path(source).expanduser().is_file():
            problems.add("eval", name, f"evaluation text {source} not found", lines.get(("eval", name)))
    try:
        return EvalSpec(**kwargs)
    except QuantkitError as exc:
        problems.add("eval", None, str(exc), lines.get(("eval",)))
        return EvalSpec(kld=False)


def _type_ok(value: Any, kind: type | tuple) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _type_name(kind: type | tuple) -> str:
    return {int: "an integer", bool: "true or false", str: "a string", list: "a list", float: "a number"}.get(
        kind, str(kind))


def _job(fields: dict[str, _Value], where: str, models: dict[str, str], options: dict[str, dict],
         problems: _Problems) -> Job | None:
    """One Job from merged fields, or None after recording its problems."""
    from quantkit.methods.registry import METHOD_NAMES

    before = len(problems.items)
    values: dict[str, Any] = {}
    for name, item in fields.items():
        kind = JOB_FIELDS.get(name)
        if kind is not None and not _type_ok(item.value, kind):
            problems.add(item.where, name, f"expected {_type_name(kind)}, got {item.value!r}", item.line)
        elif isinstance(item.value, str):
            try:
                values[name] = _env(item.value)
            except QuantkitError as exc:
                problems.add(item.where, name, str(exc), item.line)
        else:
            values[name] = item.value
    label = _label(fields, values)
    method = values.get("method", "rtn")
    if method not in METHOD_NAMES:
        problems.add(_origin(fields, "method", where), "method", f"unknown method {method!r}; use "
                     + ", ".join(METHOD_NAMES), _line(fields, "method"))
        method = None
    model_label, model = _model(values, fields, where, models, problems, label)
    opts = {n: v for n, v in values.items() if n not in JOB_FIELDS}
    if method is not None:
        for name in opts:
            if name not in options[method]:
                takers = [m for m, names in options.items() if name in names]
                problems.add(_origin(fields, name, where), name, f"{label}: not an option of {method} "
                             f"(it belongs to {', '.join(takers)})", _line(fields, name))
    configs = _configs(values, fields, where, problems, label)
    if method is not None and len(problems.items) == before:
        _check_method_options(method, configs["scheme"], opts, fields, where, problems, label)
    if len(problems.items) != before:
        return None
    scheme = configs["scheme"]
    name = values.get("name") or default_job_name(model_label, method, scheme, opts)
    try:
        return Job(name=name, model=model, method=method, scheme=scheme, method_options=opts,
                   calib=configs["calib"], load=configs["load"], batch_size=values.get("batch_size", 8),
                   quantize_lm_head=values.get("quantize_lm_head", False))
    except QuantkitError as exc:
        problems.add(where, "name" if "name" in str(exc) else None, str(exc), _line(fields, "name"))
        return None


def _origin(fields: dict[str, _Value], name: str, where: str) -> str:
    return fields[name].where if name in fields else where


def _line(fields: dict[str, _Value], name: str) -> int | None:
    return fields[name].line if name in fields else None


def _label(fields: dict[str, _Value], values: dict[str, Any]) -> str:
    """What identifies a job in a message: its name, or the fields its grid varies."""
    if "name" in values:
        return f"job {values['name']}"
    keys = [k for k in ("model", "method", "bits", "group_size", "sym") if k in values]
    return "job " + ", ".join(f"{k}={values[k]}" for k in keys)


def _model(values, fields, where, models, problems, label) -> tuple[str, str]:
    from quantkit.models.load import _looks_like_path

    spec = values.get("model")
    if spec is None:
        problems.add(where, "model", f"{label}: no model: set model in the job or in [defaults]", None)
        return "model", ""
    path_spec = models.get(spec, spec)
    if _looks_like_path(path_spec) and not Path(path_spec).expanduser().exists():
        problems.add(_origin(fields, "model", where) if spec not in models else "models", "model",
                     f"{label}: model {path_spec} not found (a folder, a .gguf file or a hub id)",
                     _line(fields, "model"))
    if spec in models:
        return spec, path_spec
    stem = Path(path_spec).name.removesuffix(".gguf") or "model"
    return stem.split(".")[0], path_spec


def _configs(values, fields, where, problems, label) -> dict[str, Any]:
    """QuantScheme, CalibConfig, LoadConfig from the fields, each field checked on its own."""
    kwargs: dict[type, dict[str, Any]] = {QuantScheme: {}, CalibConfig: {}, LoadConfig: {}}
    for name, config in _CONFIG_OF.items():
        if name in values:
            kwargs[config][name.replace("calib", "source") if name == "calib" else name] = values[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # group sizes the kernels do not serve are allowed
        for config, given in kwargs.items():
            for name, value in given.items():
                try:
                    config(**{name: value})
                except (QuantkitError, TypeError, ValueError) as exc:
                    field = "calib" if name == "source" else name
                    problems.add(_origin(fields, field, where), field, f"{label}: {exc}", _line(fields, field))
        built = {}
        for key, config in (("scheme", QuantScheme), ("calib", CalibConfig), ("load", LoadConfig)):
            try:
                built[key] = config(**kwargs[config])
            except (QuantkitError, TypeError, ValueError):
                built[key] = config()
    return built


def _check_method_options(method, scheme, opts, fields, where, problems, label) -> None:
    from quantkit.methods.registry import build_method

    method_opts = {k: v for k, v in opts.items() if k != "format"}
    if opts.get("format", "gptq") not in ("gptq", "awq"):
        problems.add(_origin(fields, "format", where), "format", f"{label}: format must be gptq or awq",
                     _line(fields, "format"))
    try:
        build_method(method, scheme, method_opts)
    except (QuantkitError, TypeError, ValueError) as exc:
        field = next(iter(method_opts), None)
        problems.add(_origin(fields, field, where) if field else where, field, f"{label}: {exc}",
                     _line(fields, field) if field else None)


def _check_unique(jobs: list[Job], problems: _Problems) -> None:
    seen: dict[str, Job] = {}
    for job in jobs:
        if job.name in seen:
            problems.add("jobs", "name", f"two jobs are named {job.name}: give one a different name", None)
        seen[job.name] = job
