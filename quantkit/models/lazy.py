"""Models larger than host memory: a safetensors folder read one decoder layer at a time.

The model is built from its config with every parameter on the meta device (no memory, no random
initialization; buffers such as rotary tables stay real). Host memory is bounded by one layer, not the model:

* each decoder layer is read from the files only when the walker asks for it, converted to the working
  dtype as it is read, and given back to the meta device as soon as its packed tensors are handed to the
  checkpoint writer;
* the input embedding is read in its stored dtype only for the calibration capture (its output cast to
  the working dtype) and released after it; RTN never reads it; the output head is read only when it is
  quantized; both are copied from the source files into the checkpoint chunk by chunk, never held;
* reads are plain file reads into buffers the process owns (:mod:`quantkit.checkpoint.stream_io`), never memory maps,
  so no page of a source file stays resident after its read;
* the small tensors outside the layers (the final norm) are read at once.

GGUF files are not streamed: they are converted by transformers as a whole (``quantkit.models.load``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from quantkit.config import LoadConfig, QuantkitError, resolve_device, resolve_dtype
from quantkit.qtensor import QuantizedWeight

log = logging.getLogger(__name__)

STREAM_MODES = ("auto", "on", "off")
# ``auto`` streams a model whose loaded size is above this fraction of the memory available now.
AUTO_STREAM_FRACTION = 0.5
# The checkpoint writer holds at most this fraction of the source model's size (one shard) while
# streaming; never less than MIN_STREAM_SHARD_BYTES per shard.
STREAM_SHARD_FRACTION = 1 / 64
MIN_STREAM_SHARD_BYTES = 16 * 2**20


def safetensors_folder(spec: str) -> Path | None:
    """``spec`` as a local folder with config.json and safetensors weights, else None."""
    path = Path(spec).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        return None
    return path if any(path.glob("*.safetensors")) else None


def stored_bytes(folder: Path) -> int:
    """Bytes of tensor data in the folder's safetensors files."""
    from quantkit.checkpoint.read import weight_files

    return sum(f.stat().st_size for f in weight_files(folder))


def available_memory_bytes() -> int:
    """Host memory available to a new allocation now (``MemAvailable``; all physical memory elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_host_memory_bytes() -> int:
    """The process's resident-memory high-water mark: Linux's ``VmHWM``, else ``getrusage``'s ``ru_maxrss``.

    Not ``ru_maxrss`` on Linux: the kernel carries it over ``exec``, so a process started by a large
    parent (Python's subprocess forks or vforks, then execs) reports at least the parent's resident size
    at that moment (measured: a child of a 1.2 GiB parent reports 1244 MiB where its own peak is 10).
    ``VmHWM`` belongs to the process's own address space, made new by ``exec``."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def loaded_bytes(folder: Path, dtype: torch.dtype) -> int:
    """Host memory the whole model takes loaded in ``dtype`` (float tensors converted, others as stored)."""
    from quantkit.checkpoint.read import index_tensors

    total = 0
    for record in index_tensors(folder).values():
        itemsize = dtype.itemsize if record.dtype.is_floating_point else record.dtype.itemsize
        total += record.numel * itemsize
    return total


@dataclass(frozen=True)
class LoadPlan:
    """Whether a model is streamed from disk, and why (printed)."""

    stream: bool
    reason: str


def plan_loading(spec: str, load: LoadConfig, *, self_calibration: bool, world_size: int = 1) -> LoadPlan:
    """Stream (``load.stream``: on, off, or auto) a local safetensors folder or load the whole model.

    ``auto`` streams whenever the walk runs on a GPU, and on the CPU when the model, loaded in its
    working dtype, would take more than half of the memory available now. On a GPU the next layer is
    read while the current one is quantized, so the load leaves the critical path (the 8B shape's GPTQ
    on one H200: 74.4 s streamed against 90.4 s whole, 3.0 against 20.2 GiB of host memory), with the
    same checkpoint. Self-generated calibration needs the whole model (it generates text with it), and
    so do several ranks (each holds its own copy today): those load it whole.
    """
    folder = safetensors_folder(spec)
    if load.stream == "off":
        return LoadPlan(False, "--stream off")
    blocker = None
    if folder is None:
        blocker = f"{spec} is not a local folder of safetensors files (GGUF files and hub ids are loaded whole)"
    elif self_calibration:
        blocker = "self-generated calibration (--calib self) generates text with the whole model"
    elif world_size > 1:
        blocker = "several ranks (--gpus) each load the whole model"
    if load.stream == "on":
        if blocker is not None:
            raise QuantkitError(f"--stream on cannot stream this run: {blocker}. Use --stream auto or off"
                                + (", or calibrate on text (--calib FILE or a named set)" if self_calibration else ""))
        return LoadPlan(True, "--stream on")
    if blocker is not None:
        return LoadPlan(False, f"whole model in memory: {blocker}")
    device = resolve_device(load.device)
    if device.startswith("cuda"):
        return LoadPlan(True, f"streamed from disk: the walk runs on {device}, which reads each layer while the "
                              "previous one is quantized (--stream off loads the whole model first)")
    dtype = resolve_dtype(load.dtype, device)
    need, have = loaded_bytes(folder, dtype), available_memory_bytes()
    sizes = f"{need / 2**30:.1f} GiB loaded in {str(dtype).removeprefix('torch.')}, {have / 2**30:.1f} GiB available"
    if need > AUTO_STREAM_FRACTION * have:
        return LoadPlan(True, f"streamed from disk: {sizes}")
    return LoadPlan(False, f"whole model in memory: {sizes} (--stream on streams it)")


def stream_shard_bytes(folder: Path, max_shard_bytes: int = 512 * 2**20) -> int:
    """Shard size for a streamed model's checkpoint: the writer holds one shard's packed tensors, so it is
    capped at 512 MiB (a 64th of a 140 GB 70B model would be 2.2 GB, five packed layers held)."""
    return max(MIN_STREAM_SHARD_BYTES, min(max_shard_bytes, int(stored_bytes(folder) * STREAM_SHARD_FRACTION)))


@dataclass
class SafetensorsLayers:
    """A :class:`~quantkit.calibrate.walker.LayerSource` reading each decoder layer from safetensors when asked.

    ``on_finish(prefix, layer, weights)`` receives each quantized layer (``weights`` by names relative to
    it) before the layer's tensors are freed; the walk keeps only shells of the packed weights (shapes
    and ``g_idx``, the rest on the meta device) for the checkpoint's config.
    """

    prefix: str
    layers: nn.ModuleList
    records: dict  # key -> quantkit.checkpoint.read.TensorRecord
    expected: dict[str, torch.Tensor]  # key -> the model's (meta) tensor, for its dtype
    on_finish: Callable[[str, nn.Module, dict[str, QuantizedWeight]], None] | None = None
    _read: set[int] = field(default_factory=set)
    files: dict = field(default_factory=dict)  # key -> quantkit.checkpoint.stream_io.FileTensor (every stored tensor)
    model: nn.Module | None = None  # the whole (meta) model, for the tensors outside the layers
    deferred: dict[str, str] = field(default_factory=dict)  # "embed" / "head" -> key of a tensor not held
    releases_layers = True  # (class attribute) each layer is dropped after ``finish``: see LayerContext.releasable

    def __len__(self) -> int:
        return len(self.layers)

    def layer(self, index: int) -> nn.Module:
        if index in self._read:
            raise RuntimeError(f"layer {index} was already read and released; a streamed model is walked once")
        self._read.add(index)
        from quantkit.checkpoint.read import _assign

        layer = self.layers[index]
        start = f"{self.prefix}.{index}."
        for key in [k for k in self.expected if k.startswith(start)]:
            tensor = self._read_tensor(key, self.expected[key].dtype)
            _assign(layer, key[len(start):], tensor, tensor.dtype, "cpu")
        _check_materialized(layer, f"{self.prefix}.{index}")
        return layer

    def _read_tensor(self, key: str, dtype: torch.dtype | None) -> torch.Tensor:
        """``key`` in ``dtype`` (floating tensors; None: as stored), read into memory this process owns."""
        from quantkit.checkpoint.stream_io import file_tensors, read_tensor

        if not self.files:
            self.files = file_tensors(self.records)
        ft = self.files[key]
        return read_tensor(ft, dtype if dtype is not None and ft.dtype.is_floating_point else None)

    @contextlib.contextmanager
    def input_embeddings(self):
        """The input embedding usable for the calibration capture, then given back to the meta device.

        Each call reads only the rows of the ids it is given (plain reads, stored dtype) into a table of
        those rows, remaps the ids onto it, and casts the output to the working dtype: the same values as
        the whole table promoted, for the memory of the rows used (a few MB, not the vocabulary)."""
        key = self.deferred.get("embed")
        if key is None or self.model is None or not isinstance(self.model.get_input_embeddings(), nn.Embedding):
            yield
            return
        from quantkit.checkpoint.stream_io import file_tensors, read_rows

        if not self.files:
            self.files = file_tensors(self.records)
        ft, embed, work_dtype = self.files[key], self.model.get_input_embeddings(), self.expected[key].dtype
        old, padding_idx = embed.weight, embed.padding_idx

        def rows_only(module, args, kwargs):
            ids = args[0] if args else kwargs.pop("input")
            used, local = torch.unique(ids, return_inverse=True)  # local ids into the table of used rows
            module._parameters["weight"] = nn.Parameter(read_rows(ft, used.cpu()).to(ids.device), requires_grad=False)
            return (local.view_as(ids), *args[1:]), kwargs

        def cast(module, args, out):
            module._parameters["weight"] = old  # the rows are dropped with the call
            return out.to(work_dtype)

        embed.padding_idx = None  # forward only (no gradients): the index must not point past the row table
        hooks = [embed.register_forward_pre_hook(rows_only, with_kwargs=True), embed.register_forward_hook(cast)]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            embed._parameters["weight"], embed.padding_idx = old, padding_idx
            return_freed_memory()

    @contextlib.contextmanager
    def output_head(self):
        """The output head materialized in the working dtype while it is quantized, released after."""
        key = self.deferred.get("head") or self.deferred.get("embed")
        head = self.model.get_output_embeddings() if self.model is not None else None
        if key is None or head is None or not head.weight.is_meta:
            yield
            return
        old = head.weight
        _swap_parameter(self.model, old, nn.Parameter(self._read_tensor(key, self.expected[key].dtype),
                                                      requires_grad=False))
        try:
            yield
        finally:
            release_parameters(head)
            release_parameters(self.model.get_input_embeddings())
            return_freed_memory()

    def writer_sources(self) -> dict:
        """key -> FileTensor for the tensors outside the layers that were never read (copied, not held)."""
        from quantkit.checkpoint.stream_io import file_tensors

        if not self.files:
            self.files = file_tensors(self.records)
        return {key: self.files[key] for key in self.deferred.values() if key in self.files}

    def finish(self, index: int, weights: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
        layer = self.layers[index]
        start = f"{self.prefix}.{index}."
        if self.on_finish is not None:
            self.on_finish(f"{self.prefix}.{index}", layer, {k[len(start):]: qw for k, qw in weights.items()})
        release_parameters(layer)
        return_freed_memory()
        return {name: weight_shell(qw) for name, qw in weights.items()}


def release_parameters(module: nn.Module) -> None:
    """Give every parameter of ``module`` back to the meta device (buffers stay: they are small)."""
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and not param.is_meta:
                sub._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)


def _swap_parameter(model: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Put ``new`` wherever ``model`` holds ``old`` (tied weights stay one object)."""
    for sub in model.modules():
        for name, param in sub._parameters.items():
            if param is old:
                sub._parameters[name] = new


def return_freed_memory() -> None:
    """Hand memory freed by the released layer back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    glibc serves allocations under 32 MiB from its heap and keeps what is freed there for reuse; with
    a layer's tensors freed in a different order than they were made, the heap fragments and the
    resident size creeps up layer after layer (measured: +300 MB over six 2048-wide layers).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where there is none."""
    return getattr(_libc(), "malloc_trim", None)


# glibc's mallopt parameter number for M_MMAP_THRESHOLD (malloc.h)
_M_MMAP_THRESHOLD = -3
STREAM_MMAP_THRESHOLD = 1 << 20


def bound_host_heap(threshold: int = STREAM_MMAP_THRESHOLD) -> bool:
    """Serve every allocation of ``threshold`` bytes or more from its own memory mapping (glibc), so that
    freeing it returns it to the system at once; returns whether the setting took.

    glibc starts with a 128 KiB threshold but raises it to the size of each mapped block freed, up to
    32 MiB, so a layer's many 1-32 MiB temporaries (float32 weights, Hessian products, the GPTQ column
    loop's rows) end up in the heap, where they fragment and stay resident: measured on a streamed
    Llama layer of hidden 1024 / MLP 4096 on the CPU, peak RSS 976 MiB with GPTQ and 583 -> 697 MiB
    creeping over 8 layers with RTN, against 821 and a flat 583 with the threshold fixed at 1 MiB.
    Setting it also stops glibc's adjustment. Process-wide: used while streaming, whose point is a
    bounded resident size."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


@functools.cache
def _libc():
    """The C library (glibc on Linux), looked up once (``find_library`` runs ``ldconfig``), or None."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    # musl has neither malloc_trim nor mallopt's glibc parameters: only glibc's are used
    return lib if hasattr(lib, "gnu_get_libc_version") else None


def weight_shell(qw: QuantizedWeight) -> QuantizedWeight:
    """``qw`` without its data: what the checkpoint's config needs (sizes, scheme, act-order from g_idx)."""
    meta = torch.device("meta")
    if not isinstance(qw, QuantizedWeight):  # FP8Weight: the config needs no tensor data
        return qw.to(meta)
    return replace(qw, qweight=qw.qweight.to(meta), qzeros=qw.qzeros.to(meta), scales=qw.scales.to(meta),
                   g_idx=qw.g_idx.to("cpu", copy=True), bias=None if qw.bias is None else qw.bias.to(meta))


def _check_materialized(module: nn.Module, what: str) -> None:
    left = [name for name, param in module.named_parameters() if param.is_meta]
    if left:
        raise QuantkitError(f"{what}: the files lack {', '.join(left)}")


def open_streamed(spec: str, load: LoadConfig):
    """(LoadedModel, SafetensorsLayers) for a safetensors folder: everything but the decoder layers read."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from quantkit.arch import find_decoder_layers
    from quantkit.checkpoint.read import _assign, check_tensors, index_tensors, parameters_on_meta
    from quantkit.models.load import LoadedModel, quiet_transformers

    folder = Path(spec).expanduser()
    dtype = resolve_dtype(load.dtype, resolve_device(load.device))
    records = index_tensors(folder)
    bound_host_heap()  # freed layer temporaries go back to the system, not into a fragmenting heap
    remote = {"trust_remote_code": load.trust_remote_code}
    with quiet_transformers():
        config = AutoConfig.from_pretrained(str(folder), **remote)
        if getattr(config, "quantization_config", None) is not None:
            raise QuantkitError(f"{spec} is already quantized (config.json has quantization_config)")
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **remote)
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **remote)
    from quantkit.moe.layout import prepare_moe_model

    prepare_moe_model(model)  # MoE: per-expert linears under the files' own per-expert names
    expected = check_tensors(model, records)
    prefix, layers = find_decoder_layers(model)
    inside = prefix + "."
    deferred = _embedding_keys(model, expected)
    source = SafetensorsLayers(prefix, layers, records, expected, model=model, deferred=deferred)
    for key in [k for k in expected if not k.startswith(inside) and k not in deferred.values()]:
        tensor = source._read_tensor(key, expected[key].dtype)  # the small ones (final norm): read at once
        _assign(model, key, tensor, tensor.dtype, "cpu")
    model.tie_weights()
    _load_generation_config(model, folder)
    model.eval()
    use_cache = getattr(model.config, "use_cache", None)
    model.config.use_cache = False  # calibration forwards need no KV cache
    loaded = LoadedModel(model=model, tokenizer=tokenizer, source=spec, use_cache=use_cache)
    return loaded, source


def _embedding_keys(model: nn.Module, expected: dict[str, torch.Tensor]) -> dict[str, str]:
    """Keys of the input embedding ("embed") and an output head stored apart from it ("head") in the files."""
    out = {}
    names = {id(m): n for n, m in model.named_modules()}
    for role, module in (("embed", model.get_input_embeddings()), ("head", model.get_output_embeddings())):
        if module is None or id(module) not in names:
            continue
        key = f"{names[id(module)]}.weight".lstrip(".")
        if key in expected:
            out[role] = key
    return out


def open_model(spec: str, load: LoadConfig, plan: LoadPlan):
    """(LoadedModel, SafetensorsLayers or None): streamed as ``plan`` says, else loaded whole. Files that do not
    match the model's config exactly are loaded whole under ``--stream auto`` (transformers renames old keys)."""
    from quantkit.models.load import load_model

    if plan.stream:
        try:
            return open_streamed(spec, load)
        except QuantkitError as exc:
            if load.stream == "on":
                raise
            log.warning("cannot stream %s (%s); loading the whole model instead", spec, exc)
    return load_model(spec, load), None


def _load_generation_config(model: nn.Module, folder: Path) -> None:
    from transformers import GenerationConfig

    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(folder))


def stream_to_writer(loaded, source: SafetensorsLayers, output: Path, *, scheme, layout: str, overwrite: bool):
    """A checkpoint writer that ``source`` hands each quantized layer to (pass it to ``save_quantized``)."""
    from quantkit.checkpoint.save import add_layer, open_writer

    shard_bytes = stream_shard_bytes(Path(loaded.source).expanduser())
    writer = open_writer(loaded.model, output, scheme=scheme, layout=layout, overwrite=overwrite,
                         max_shard_bytes=shard_bytes)
    writer.file_sources = source.writer_sources()
    source.on_finish = lambda prefix, layer, weights: add_layer(writer, layer, prefix, weights)
    return writer
