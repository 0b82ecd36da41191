"""Calibration activations by batch: where they live must not change what a method computes.

* GPTQ quantized group by group over the calibration batches (Hessians accumulated batch by batch,
  what accelerators do by default) against the single pass over the whole set (the CPU default).
* Hidden states offloaded to host memory against kept on the device (GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch

from quantkit.calibrate.activations import offload_activations
from quantkit.calibrate.walker import walk
from quantkit.config import QuantkitError, QuantScheme
from quantkit.methods.awq import AWQConfig
from quantkit.methods.awq_method import AWQMethod
from quantkit.methods.gptq import GPTQConfig
from quantkit.methods.gptq_method import GPTQMethod
from quantkit.primitives import dequantize
from tests.walking import small_method, tiny_llama, walk_tiny


def _weights(result) -> dict[str, torch.Tensor]:
    out = {}
    for name, qw in result.weights.items():
        codes, zeros = qw.unpack("cpu")
        out[name] = dequantize(codes, qw.scales.float().cpu(), zeros, qw.g_idx.cpu())
    return out


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_by_batches_matches_the_single_pass(desc_act):
    """Same codes except where the Hessians' summation order flips a rounding tie: the batched Hessian
    is a running mean over 4 batches, the single pass one over all 8 windows at once, equal to float32
    rounding. A flipped code changes the error GPTQ pushes onto the rest of its row, and the next layer
    sees slightly other inputs, so a few flips cascade (measured: layer 0 identical, at most 1.3 % of
    one linear's codes in layer 1, 3.2 % of its weight norm). Bounds: 2 % of codes, 5 % of the weight
    norm, the GPTQ output error within 10 %; wrong inputs or Hessians miss them by far. The model is
    left holding exactly the packed weights either way (the method installs them itself)."""
    scheme = QuantScheme(4, 32, True)
    whole = tiny_llama(2)
    batched = copy.deepcopy(whole)
    res_whole = walk_tiny(whole, GPTQMethod(scheme, GPTQConfig(desc_act=desc_act)))  # CPU default: single pass
    res_batched = walk_tiny(batched, GPTQMethod(scheme, GPTQConfig(desc_act=desc_act, single_pass_max_tokens=0)))
    w1, w2 = _weights(res_whole), _weights(res_batched)
    assert w1.keys() == w2.keys() and len(w1) == 14
    for name in w1:
        c1, c2 = res_whole.weights[name].unpack("cpu")[0], res_batched.weights[name].unpack("cpu")[0]
        assert (c1 != c2).float().mean() <= 0.02, name
        assert (w1[name] - w2[name]).norm() <= 0.05 * w1[name].norm(), name
        e1, e2 = (r.layer_stats[int(name.split(".")[2])]["linears"][name.split(".", 3)[3]]["err_gptq"]
                  for r in (res_whole, res_batched))
        assert abs(e1 - e2) <= 0.1 * e1, name
        linear = batched.get_submodule(name)
        assert torch.equal(linear.weight.data, w2[name].to(linear.weight.dtype)), name


def test_awq_batches_of_two_match_one_batch_of_all():
    """AWQ's statistics summed batch by batch (4 batches of 2 windows; each input batch dropped once
    its output exists) against one batch of all 8 windows: the same scales and clips up to the float32
    summation order of the channel means, so at most 1 % of codes differ, weights by at most 1 %."""
    scheme = QuantScheme(4, 32, False)
    config = AWQConfig(grid=4, clip_grid=4, clip_tokens=64, search_samples=4)
    one = tiny_llama(2)
    four = copy.deepcopy(one)
    ids = torch.randint(0, one.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(1))
    r1 = walk(one, AWQMethod(scheme, config), device="cpu", token_ids=ids, batch_size=8)
    r4 = walk(four, AWQMethod(scheme, config), device="cpu", token_ids=ids, batch_size=2)
    w1, w4 = _weights(r1), _weights(r4)
    assert w1.keys() == w4.keys() and len(w1) == 14
    for name in w1:
        c1, c4 = r1.weights[name].unpack("cpu")[0], r4.weights[name].unpack("cpu")[0]
        assert (c1 != c4).float().mean() <= 0.01, name
        assert (w1[name] - w4[name]).norm() <= 0.01 * w1[name].norm(), name


def test_copy_home_writes_into_the_resident_host_tensors():
    """The way back reuses the host tensors a layer came from (no fresh host memory); a tensor whose
    shape changed on the way is moved the plain way."""
    from quantkit.calibrate.activations import copy_home, host_tensors

    layer = tiny_llama(2).model.layers[0]
    resident = host_tensors(layer)
    before = {id(t): t.data_ptr() for _, _, t in resident}
    q = layer.self_attn.q_proj
    q.weight.data = q.weight.data.clone() + 1.0  # stands in for the device copy the method changed
    layer.input_layernorm.weight.data = torch.zeros(3)  # a shape change
    expected_q = q.weight.data.clone()
    copy_home(layer, resident)
    assert q.weight.data.data_ptr() == before[id(next(t for m, k, t in resident if m is q and k == "weight"))]
    assert torch.equal(q.weight.data, expected_q)
    assert layer.input_layernorm.weight.shape == (3,)


def test_gptq_default_single_pass_on_the_cpu_by_tokens_on_cuda_by_free_memory():
    config = GPTQConfig()
    assert config.single_pass_limit(torch.device("cpu")) == 1 << 19
    assert config.single_pass_limit(torch.device("cuda")) is None  # gptq_method.single_pass_fits decides
    assert config.single_pass_limit(torch.device("mps")) == 0
    assert GPTQConfig(single_pass_max_tokens=7).single_pass_limit(torch.device("cuda")) == 7


def test_offload_policy():
    cuda = torch.device("cuda")
    assert offload_activations("host", 1, cuda) is True
    assert offload_activations("device", 1 << 50, cuda) is False
    assert offload_activations("host", 1, torch.device("cpu")) is False  # already host memory
    with pytest.raises(QuantkitError, match="activations must be one of"):
        offload_activations("disk", 1, cuda)


def test_walk_reports_its_phases():
    events = []
    walk_tiny(tiny_llama(2), GPTQMethod(QuantScheme(4, 32, True)), on_layer=events.append)
    assert {"move_in", "method", "install", "propagate", "move_out"} <= set(events[0].phases)
    assert abs(sum(v for k, v in events[0].phases.items() if "." not in k) - events[0].seconds) < 1e-6


CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_host_activations_give_the_same_weights_as_device(method):
    """Offloading the hidden states to pinned host memory moves bytes, not arithmetic: bitwise equal."""
    on_device = tiny_llama(2).to(torch.bfloat16)
    on_host = copy.deepcopy(on_device)
    r1 = walk_tiny(on_device, small_method(method), "cuda", activations="device")
    r2 = walk_tiny(on_host, small_method(method), "cuda", activations="host")
    for name, qw in r1.weights.items():
        assert torch.equal(qw.qweight, r2.weights[name].qweight), name
        assert torch.equal(qw.scales, r2.weights[name].scales), name
