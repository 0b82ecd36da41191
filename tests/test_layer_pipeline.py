"""The walker's overlapped layer traffic (quantkit/calibrate/pipeline.py): the same calls in the same order, the same
weights, the model left as before.

On the CPU the worker thread runs without copies (``threaded=True``); ``-m gpu`` walks a tiny model on CUDA with
the overlap on and off and asks for bitwise equal results.
"""

from __future__ import annotations

import copy

import pytest
import torch

from quantkit.calibrate.pipeline import LayerPipeline, weight_to_host
from quantkit.calibrate.walker import ModelLayers, find_decoder_layers
from quantkit.config import QuantScheme
from quantkit.methods.awq import AWQConfig
from quantkit.methods.awq_method import AWQMethod
from quantkit.qtensor import QuantizedWeight
from tests.walking import small_method, tiny_llama, walk_tiny


def _qw(seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (8, 64), dtype=torch.int32, generator=g)
    return QuantizedWeight.from_codes(codes, torch.rand(2, 8, generator=g) + 0.1,
                                      torch.full((2, 8), 8, dtype=torch.int32), torch.arange(64) // 32,
                                      QuantScheme(4, 32, False))


class _Recording(ModelLayers):
    def __init__(self, prefix, layers, log):
        super().__init__(prefix, layers)
        self.log = log

    def layer(self, index):
        self.log.append(("layer", index))
        return super().layer(index)

    def finish(self, index, weights):
        self.log.append(("finish", index))
        return super().finish(index, weights)


@pytest.mark.parametrize("threaded", [False, True])
def test_source_sees_one_layer_ahead_and_one_behind(threaded):
    log: list = []
    qws = [_qw(i) for i in range(3)]
    prefix, layers = find_decoder_layers(tiny_llama(3))
    source = _Recording(prefix, layers, log)
    with LayerPipeline(source, torch.device("cpu"), threaded=threaded) as pipe:
        for i in range(len(source)):
            layer, resident = pipe.take(i)
            assert layer is layers[i] and resident is None
            pipe.start(i + 1)
            pipe.finish(i, {f"w{i}": qws[i]}, layer, resident, torch.device("cpu"))
        out = pipe.results()
    assert list(out) == ["w0", "w1", "w2"] and all(out[f"w{i}"] is qws[i] for i in range(3))
    if threaded:
        assert log == [("layer", 0), ("layer", 1), ("finish", 0), ("layer", 2), ("finish", 1), ("finish", 2)]
    else:
        assert log == [("layer", 0), ("finish", 0), ("layer", 1), ("finish", 1), ("layer", 2), ("finish", 2)]


def test_worker_errors_reach_the_caller():
    class Broken(ModelLayers):
        def layer(self, index):
            if index == 1:
                raise RuntimeError("unreadable layer 1")
            return super().layer(index)

    prefix, layers = find_decoder_layers(tiny_llama(3))
    with LayerPipeline(Broken(prefix, layers), torch.device("cpu"), threaded=True) as pipe:
        pipe.take(0)
        pipe.start(1)
        with pytest.raises(RuntimeError, match="unreadable layer 1"):
            pipe.take(1)


def test_weight_to_host_keeps_host_weights():
    qw = _qw()
    assert weight_to_host(qw) is qw


def test_awq_leaves_the_model_holding_its_packed_weights():
    """AWQ installs the dequantized weights itself (``installed``): they must be what the packed codes give."""
    model = tiny_llama(2)
    result = walk_tiny(model, AWQMethod(QuantScheme(4, 32, False), AWQConfig(grid=4, clip_grid=4)), "cpu")
    assert result.layer_stats[0]["linears"]["mlp.down_proj"]["weight_error"] > 0
    for name, qw in result.weights.items():
        assert qw.qweight.device.type == "cpu"
        assert torch.equal(model.get_submodule(name).weight.data, qw.dequantize().to(torch.float32)), name


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_overlap_gives_the_same_weights_on_cuda(method):
    a = tiny_llama(3).to(torch.bfloat16)
    b = copy.deepcopy(a)
    r1 = walk_tiny(a, small_method(method), "cuda", overlap=True)
    r2 = walk_tiny(b, small_method(method), "cuda", overlap=False)
    assert r1.weights.keys() == r2.weights.keys()
    for name, qw in r1.weights.items():
        assert qw.qweight.device.type == "cpu" and r2.weights[name].qweight.device.type == "cpu"
        assert torch.equal(qw.qweight, r2.weights[name].qweight), name
        assert torch.equal(qw.scales, r2.weights[name].scales), name
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.device.type == "cpu" and torch.equal(p, q), n


@pytest.mark.gpu
def test_gptq_packs_on_the_device_as_on_the_host():
    """GPTQ packs where its codes are (the worker brings them to the host): the same bytes as packing there."""
    from quantkit.qtensor import QuantizedWeight

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (96, 256), generator=g, dtype=torch.int32)  # [out, in]
    zeros = torch.randint(1, 16, (2, 96), generator=g, dtype=torch.int32)  # [G, out]
    scales = torch.rand(2, 96, generator=g) * 0.1
    g_idx = torch.arange(256, dtype=torch.int32) // 128
    bias = torch.randn(96, generator=g)
    scheme = QuantScheme(4, 128, True)
    host = QuantizedWeight.from_codes(codes, scales, zeros, g_idx, scheme, bias=bias)
    dev = QuantizedWeight.from_codes(codes.cuda(), scales.cuda(), zeros.cuda(), g_idx.cuda(), scheme,
                                     bias=bias.cuda(), device="cuda")
    for f in ("qweight", "qzeros", "scales", "g_idx", "bias"):
        assert getattr(dev, f).device.type == "cuda"
        assert torch.equal(getattr(dev, f).cpu(), getattr(host, f)), f
