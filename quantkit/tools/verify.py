"""``quantkit verify``: does the serving runtime compute what the checkpoint means?

A few prompts go through the runtime as it serves (``backend="auto"``: the Triton kernels on CUDA, the
reference ops elsewhere) and through independent references; their logits are compared position by
position. References:

* ``runtime``: the same runtime with ``backend="reference"`` in float32 (plain PyTorch ops): isolates
  the kernels. Only meaningful when the served path uses the kernels (on CUDA).
* ``transformers``: transformers' own modeling code on the same checkpoint, read by quantkit's tested
  reader (:func:`quantkit.checkpoint.read.load_quantized`, float32 on the CPU): an independent decoder, so the
  check means something on the CPU too (our decoder against transformers').

:func:`compare_logits` is the pure core (two logits tensors in, a record out). With a base model, the
bounded-slice perplexity of base and served model and their KL divergence are added (:func:`compare_to_base`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from quantkit.config import QuantkitError, resolve_device, resolve_dtype
from quantkit.eval.kld import KLDStats, summarize_kld, token_kld

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Quantization stores each weight in four bits, which",
    "Once upon a time, in a small village by the sea, there lived",
)
REFERENCES = ("runtime", "transformers")
MAX_PROMPTS = 64
MAX_PROMPT_TOKENS = 512


@dataclass(frozen=True)
class Tolerance:
    """When the served logits count as agreeing with a reference.

    ``max_rel_err``: bound on ``||test - ref|| / ||ref||`` over all positions (Frobenius norms).
    ``min_top1``: least share of positions whose top-1 token agrees, a flip counting as agreement when
    the reference's gap between the two tokens is within the error allowed on two logits (a logit tie).
    """

    max_rel_err: float
    min_top1: float = 0.98

    def __post_init__(self) -> None:
        if not self.max_rel_err > 0:
            raise QuantkitError(f"--rtol must be > 0, got {self.max_rel_err}")
        if not 0 <= self.min_top1 <= 1:
            raise QuantkitError(f"--min-top1 must be in [0, 1], got {self.min_top1}")


def default_tolerance(dtype: torch.dtype) -> Tolerance:
    """float32 paths agree to rounding (1e-3 leaves room for other summation orders); 16-bit ones
    carry one rounding per matmul through every layer (bf16: 8 mantissa bits, fp16: 11)."""
    rel = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(dtype, 5e-2)
    return Tolerance(max_rel_err=rel)


@dataclass(frozen=True)
class LogitsComparison:
    """How far one path's logits ``[N, V]`` are from a reference's.

    ``flip_gaps``: for each position whose top-1 differs, the reference's logit gap between the two
    tokens over the row's RMS logit; a flip counts as a tie under a tolerance when that gap is within
    the error the tolerance allows on two logits (``2 * max_rel_err``)."""

    n_positions: int
    max_abs_err: float
    mean_abs_err: float
    rel_err: float
    top1_agreement: float  # plain argmax equality
    n_nonfinite: int
    flip_gaps: tuple[float, ...] = ()

    def top1_with_ties(self, tolerance: Tolerance) -> float:
        ties = sum(gap <= 2 * tolerance.max_rel_err for gap in self.flip_gaps)
        return self.top1_agreement + ties / self.n_positions

    def problems(self, tolerance: Tolerance) -> list[str]:
        found = []
        if self.n_nonfinite:
            found.append(f"{self.n_nonfinite} non-finite logits")
        if not self.rel_err <= tolerance.max_rel_err:
            found.append(f"relative error {self.rel_err:.3g} > {tolerance.max_rel_err:.3g}")
        top1 = self.top1_with_ties(tolerance)
        if not top1 >= tolerance.min_top1:
            found.append(f"top-1 agreement {top1:.1%} (ties forgiven) < {tolerance.min_top1:.1%}")
        return found


def compare_logits(test: torch.Tensor, reference: torch.Tensor) -> LogitsComparison:
    """Compare logits ``[..., V]`` of the same positions (any float dtype; computed in float32)."""
    if test.shape != reference.shape or test.dim() < 1 or test.shape[-1] == 0:
        raise ValueError(f"logits must have the same shape [..., V]; got {tuple(test.shape)} "
                         f"and {tuple(reference.shape)}")
    test = test.reshape(-1, test.shape[-1]).float()  # [N, V]
    reference = reference.reshape(-1, reference.shape[-1]).float()
    if test.shape[0] == 0:
        raise ValueError("no positions to compare")
    n_nonfinite = int((~torch.isfinite(test)).sum() + (~torch.isfinite(reference)).sum())
    diff = (test - reference).abs()
    test_top, ref_top = test.argmax(-1, keepdim=True), reference.argmax(-1, keepdim=True)  # [N, 1]
    flipped = (test_top != ref_top).squeeze(-1)  # [N]
    gap = (reference.gather(-1, ref_top) - reference.gather(-1, test_top)).squeeze(-1)  # [N], >= 0
    rms = reference.pow(2).mean(-1).sqrt().clamp_min(1e-30)  # [N]
    return LogitsComparison(
        n_positions=test.shape[0],
        max_abs_err=diff.max().item(),
        mean_abs_err=diff.mean().item(),
        rel_err=((test - reference).norm() / reference.norm().clamp_min(1e-30)).item(),
        top1_agreement=1.0 - flipped.float().mean().item(),
        n_nonfinite=n_nonfinite,
        flip_gaps=tuple((gap[flipped] / rms[flipped]).tolist()),
    )


@dataclass(frozen=True)
class DecodeComparison:
    """Greedy tokens the engine decoded (KV cache, decode kernels, CUDA graphs) against the reference's
    argmax on the same sequences (teacher-forced, so later tokens stay comparable after a flip).

    ``flip_gaps``: for each disagreeing token, the reference's gap between its argmax and the engine's
    token over the row's RMS logit (a tie under a tolerance as in :class:`LogitsComparison`)."""

    n_tokens: int
    n_exact: int
    first_disagreement: int | None
    flip_gaps: tuple[float, ...] = ()

    def agreement(self, tolerance: Tolerance) -> float:
        ties = sum(gap <= 2 * tolerance.max_rel_err for gap in self.flip_gaps)
        return (self.n_exact + ties) / self.n_tokens

    def problems(self, tolerance: Tolerance) -> list[str]:
        agreement = self.agreement(tolerance)
        if agreement >= tolerance.min_top1:
            return []
        return [f"greedy decode agreed on {agreement:.1%} of {self.n_tokens} tokens (ties forgiven) < "
                f"{tolerance.min_top1:.1%}; first disagreement at generated token {self.first_disagreement}"]


def compare_greedy(tokens: torch.Tensor, reference: torch.Tensor) -> DecodeComparison:
    """Engine tokens ``[N]`` against the reference's logits ``[N, V]`` at the positions that predicted them."""
    if tokens.dim() != 1 or reference.dim() != 2 or tokens.shape[0] != reference.shape[0] or tokens.numel() == 0:
        raise ValueError(f"need tokens [N] and logits [N, V]; got {tuple(tokens.shape)} and {tuple(reference.shape)}")
    reference = reference.float()
    best = reference.argmax(-1)  # [N]
    flipped = best != tokens
    gap = (reference.gather(-1, best[:, None]) - reference.gather(-1, tokens[:, None].long())).squeeze(-1)  # [N]
    rms = reference.pow(2).mean(-1).sqrt().clamp_min(1e-30)  # [N]
    first = int(flipped.nonzero()[0, 0]) if flipped.any() else None
    return DecodeComparison(n_tokens=tokens.numel(), n_exact=int((~flipped).sum()), first_disagreement=first,
                            flip_gaps=tuple((gap / rms)[flipped].tolist()))


@dataclass(frozen=True)
class PathResult:
    """The served path against one reference: per prompt and over all positions."""

    reference: str
    per_prompt: tuple[LogitsComparison, ...]
    overall: LogitsComparison
    tolerance: Tolerance
    decode: DecodeComparison | None = None

    @property
    def problems(self) -> list[str]:
        found = self.overall.problems(self.tolerance)
        return found + (self.decode.problems(self.tolerance) if self.decode is not None else [])

    @property
    def passed(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class BaseResult:
    """The served model against its unquantized base on a bounded slice of text."""

    base: str
    data: str
    ppl_base: float
    ppl_quant: float  # from the served path's logits, windows as quantkit.eval.perplexity cuts them
    kld: KLDStats
    n_windows: int
    seqlen: int


@dataclass(frozen=True)
class VerifyReport:
    model: str
    device: str
    dtype: str
    backend: str
    prompt_tokens: tuple[int, ...]
    paths: tuple[PathResult, ...]
    base: BaseResult | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.paths)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["passed"] = self.passed
        for path, raw in zip(self.paths, out["paths"]):
            raw["passed"], raw["problems"] = path.passed, path.problems
            raw["overall"]["top1_with_ties"] = path.overall.top1_with_ties(path.tolerance)
            if path.decode is not None:
                raw["decode"]["agreement_with_ties"] = path.decode.agreement(path.tolerance)
        return out


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a text file, one per non-empty line (``\\n`` inside a line stands for a newline)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise QuantkitError(f"--prompts {path}: no such file (one prompt per line)")
    prompts = [line.replace("\\n", "\n") for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise QuantkitError(f"--prompts {path} holds no prompt (one prompt per non-empty line)")
    if len(prompts) > MAX_PROMPTS:
        raise QuantkitError(f"--prompts {path} holds {len(prompts)} prompts; verify takes at most {MAX_PROMPTS}")
    return prompts


def _engine_loader():
    try:
        from quantkit.runtime.loader import load_engine
    except ImportError as exc:
        raise QuantkitError(f"this quantkit has no serving runtime (quantkit.runtime.loader: {exc})") from exc
    return load_engine


def greedy_through_engine(model: str, batches: list[torch.Tensor], n_tokens: int, *, device: str, dtype: str,
                          backend: str, trust_remote_code: bool = False) -> list[list[int]]:
    """``n_tokens`` greedy tokens per prompt from the engine ``serve`` runs (prefill, then decode steps over
    the KV cache; CUDA graphs where the runtime uses them), all prompts batched together, EOS ignored."""
    from quantkit.runtime.types import SamplingParams

    longest = max(batch.shape[1] for batch in batches)
    engine = _engine_loader()(model, device=device, dtype=dtype, backend=backend, max_batch=len(batches),
                              max_seq_len=longest + n_tokens + 1, trust_remote_code=trust_remote_code)
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    index = {engine.add_request(batch[0].tolist(), params): i for i, batch in enumerate(batches)}
    tokens: list[list[int]] = [[] for _ in batches]
    pending = set(index)
    for _ in range(n_tokens + len(batches) + 8):  # a bound: every step decodes one token of each running request
        if not pending:
            break
        for event in engine.step():
            if event.token_id is not None:
                tokens[index[event.request_id]].append(int(event.token_id))
            if event.finished:
                pending.discard(event.request_id)
    if pending or any(len(t) < n_tokens for t in tokens):
        counts = [len(t) for t in tokens]
        raise RuntimeError(f"the engine did not decode {n_tokens} tokens for every prompt: got {counts}")
    return [t[:n_tokens] for t in tokens]


def _runtime_loader():
    try:
        from quantkit.runtime.loader import load_runtime_model
    except ImportError as exc:
        raise QuantkitError(f"this quantkit has no serving runtime (quantkit.runtime.loader: {exc})") from exc
    return load_runtime_model


def _prompt_ids(tokenizer, prompts: Sequence[str], limit: int) -> list[torch.Tensor]:
    if tokenizer is None:
        raise QuantkitError("the model has no tokenizer files; verify needs one to tokenize its prompts")
    batches = []
    for prompt in prompts:
        ids = list(tokenizer(prompt)["input_ids"])[: min(limit, MAX_PROMPT_TOKENS)]
        if not ids:
            raise QuantkitError(f"the prompt {prompt!r} has no tokens")
        batches.append(torch.tensor([ids], dtype=torch.long))  # [1, T]
    return batches


def _logits_of(forward: Callable[[torch.Tensor], torch.Tensor], batches: list[torch.Tensor], device) -> list:
    with torch.inference_mode():
        return [forward(ids.to(device))[0].float().cpu() for ids in batches]  # each [T, V]


def _transformers_forward(model: str, trust_remote_code: bool) -> Callable:
    """transformers' decoder on the checkpoint, float32 on the CPU (QuantLinear's reference path)."""
    from quantkit.checkpoint.read import load_quantized
    from quantkit.checkpoint.settings import is_quantized_checkpoint

    if is_quantized_checkpoint(model):
        net, _ = load_quantized(model, device="cpu", dtype=torch.float32)
    else:
        from quantkit.config import LoadConfig
        from quantkit.models.load import load_any

        net, _ = load_any(model, LoadConfig(dtype="float32", device="cpu", trust_remote_code=trust_remote_code))
    net.eval()
    return lambda ids: net(input_ids=ids.cpu(), use_cache=False).logits


def _reference_logits(reference: str, model: str, batches, device: str, trust_remote_code: bool) -> list:
    if reference == "transformers":
        return _logits_of(_transformers_forward(model, trust_remote_code), batches, "cpu")
    ref_model, _ = _runtime_loader()(model, device=device, dtype="float32", backend="reference",
                                     trust_remote_code=trust_remote_code)
    logits = _logits_of(ref_model.forward_logits, batches, device)
    del ref_model
    return logits


def _choose_references(references: Sequence[str] | str, backend_used: str) -> tuple[str, ...]:
    if references == "auto" or references == ("auto",):
        # The runtime's reference backend is independent only of the kernels; on the CPU the served path
        # already is that backend, so transformers' decoder is the independent check there.
        return ("runtime", "transformers") if backend_used == "kernels" else ("transformers",)
    chosen = (references,) if isinstance(references, str) else tuple(references)
    unknown = [r for r in chosen if r not in REFERENCES]
    if unknown or not chosen:
        raise QuantkitError(f"--reference must be auto or one of {', '.join(REFERENCES)}, got {unknown or chosen}")
    return chosen


def verify(
    model: str,
    *,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    references: Sequence[str] | str = "auto",
    device: str = "auto",
    dtype: str = "auto",
    backend: str = "auto",
    rtol: float | None = None,
    min_top1: float = 0.98,
    base: str | None = None,
    data: str | None = None,
    seqlen: int = 512,
    max_windows: int = 4,
    decode_tokens: int = 16,
    trust_remote_code: bool = False,
) -> VerifyReport:
    """Compare the served path's logits on ``prompts`` with each reference; with ``base``, add
    perplexity and KL divergence against the unquantized model on ``data`` (a local text file).

    ``rtol`` None: :func:`default_tolerance` of the served dtype. ``decode_tokens`` > 0 also decodes that
    many greedy tokens per prompt through the engine and checks each against the reference's argmax."""
    if base is not None and data is None:
        raise QuantkitError("--base needs --data FILE: a local .txt/.jsonl/.parquet text (verify never downloads), "
                            "e.g. --data ../shared/data/wikitext2/test.raw.txt")
    if rtol is not None:
        Tolerance(max_rel_err=rtol, min_top1=min_top1)  # bad values fail before any model loads
    if decode_tokens < 0:
        raise QuantkitError(f"--decode-tokens must be >= 0, got {decode_tokens}")
    dev = resolve_device(device)
    test_model, tokenizer = _runtime_loader()(model, device=dev, dtype=dtype, backend=backend,
                                              trust_remote_code=trust_remote_code)
    backend_used = getattr(test_model, "backend", backend)
    limit = int(getattr(test_model.config, "max_position_embeddings", MAX_PROMPT_TOKENS))
    batches = _prompt_ids(tokenizer, prompts, limit)
    test_logits = _logits_of(test_model.forward_logits, batches, dev)
    rtol = default_tolerance(resolve_dtype(dtype, dev)).max_rel_err if rtol is None else rtol
    tolerance = Tolerance(max_rel_err=rtol, min_top1=min_top1)
    base_result = None
    if base is not None:
        base_result = compare_to_base(test_model.forward_logits, tokenizer, base, data, device=dev, dtype=dtype,
                                      seqlen=seqlen, max_windows=max_windows, trust_remote_code=trust_remote_code)
    del test_model
    decoded = None
    if decode_tokens:
        decoded = greedy_through_engine(model, batches, decode_tokens, device=dev, dtype=dtype, backend=backend,
                                        trust_remote_code=trust_remote_code)
    paths, notes = [], []
    chosen = _choose_references(references, backend_used)
    if "runtime" in chosen and backend_used == "reference":
        notes.append("the served path already runs the runtime's reference ops: the runtime reference compares them "
                     "with themselves in float32; use --reference transformers for an independent check")
    for reference in chosen:
        log.info("verify: reference %s", reference)
        paths.append(_compare_path(reference, model, batches, test_logits, decoded, tolerance, dev,
                                   trust_remote_code))
    return VerifyReport(model=model, device=dev, dtype=str(resolve_dtype(dtype, dev)).removeprefix("torch."),
                        backend=str(backend_used), prompt_tokens=tuple(b.shape[1] for b in batches),
                        paths=tuple(paths), base=base_result, notes=tuple(notes))


def _compare_path(reference: str, model: str, batches: list[torch.Tensor], test_logits: list[torch.Tensor],
                  decoded: list[list[int]] | None, tolerance: Tolerance, device: str,
                  trust_remote_code: bool) -> PathResult:
    """One reference over each prompt followed by the engine's tokens (all but the last): its logits on the
    prompt positions against the served forward, and its argmax after them against the engine's tokens."""
    sequences = batches
    if decoded is not None:
        sequences = [torch.cat([b, torch.tensor([d[:-1]], dtype=torch.long)], dim=1) for b, d in zip(batches, decoded)]
    ref_logits = _reference_logits(reference, model, sequences, device, trust_remote_code)
    prompt_logits = [r[: b.shape[1]] for r, b in zip(ref_logits, batches)]
    per_prompt = tuple(compare_logits(t, r) for t, r in zip(test_logits, prompt_logits))
    overall = compare_logits(torch.cat(test_logits), torch.cat(prompt_logits))
    decode = None
    if decoded is not None:
        # Position P - 1 + k predicted generated token k (P prompt tokens).
        predicting = [r[b.shape[1] - 1 :] for r, b in zip(ref_logits, batches)]
        decode = compare_greedy(torch.tensor([t for d in decoded for t in d]), torch.cat(predicting))
    return PathResult(reference, per_prompt, overall, tolerance, decode)


def compare_to_base(forward_logits: Callable, tokenizer, base: str, data: str, *, device: str, dtype: str,
                    seqlen: int, max_windows: int, trust_remote_code: bool = False) -> BaseResult:
    """Perplexity of ``base`` (:func:`quantkit.eval.perplexity.perplexity`) and of the served path, and
    ``KL(base || served)`` per token, on the first ``max_windows`` windows of ``seqlen`` tokens of ``data``."""
    from quantkit.config import LoadConfig
    from quantkit.eval.perplexity import load_eval_tokens, needs_bos, perplexity
    from quantkit.models.load import load_any

    if not Path(data).expanduser().is_file():
        raise QuantkitError(f"--data {data}: no such file (verify reads local text only; it never downloads)")
    if max_windows < 1:
        raise QuantkitError(f"--max-windows must be at least 1, got {max_windows}")
    base_model, _ = load_any(base, LoadConfig(dtype=dtype, device=device, trust_remote_code=trust_remote_code))
    base_model.to(device).eval()
    token_ids = load_eval_tokens(data, tokenizer)
    bos = tokenizer.bos_token_id if needs_bos(tokenizer, base_model.config) else None
    base_ppl = perplexity(base_model, token_ids, seqlen=seqlen, max_windows=max_windows, bos_token_id=bos,
                          device=device)
    text_per_window = seqlen - (1 if bos is not None else 0)
    kls, changed, nll, n_scored = [], [], 0.0, 0
    with torch.inference_mode():
        for index in range(base_ppl.n_windows):
            window = token_ids[index * text_per_window : (index + 1) * text_per_window]
            if bos is not None:
                window = torch.cat([window.new_tensor([bos]), window])
            window = window.unsqueeze(0).to(device)  # [1, seqlen]
            quant = forward_logits(window)[0, :-1].float()  # [seqlen - 1, V]: the last position predicts nothing
            reference = base_model(input_ids=window, use_cache=False).logits[0, :-1].float()
            if quant.shape != reference.shape:
                raise QuantkitError(f"--base {base} has logits {tuple(reference.shape)} but the model "
                                    f"{tuple(quant.shape)}: is it the same architecture and tokenizer?")
            kl, flip = token_kld(reference, quant)
            kls.append(kl.cpu())
            changed.append(flip.cpu())
            nll += F.cross_entropy(quant, window[0, 1:], reduction="sum").item()
            n_scored += quant.shape[0]
    return BaseResult(base=base, data=str(data), ppl_base=base_ppl.ppl, ppl_quant=math.exp(nll / n_scored),
                      kld=summarize_kld(torch.cat(kls), torch.cat(changed)), n_windows=base_ppl.n_windows,
                      seqlen=seqlen)
