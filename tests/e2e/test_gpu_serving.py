"""A quantized checkpoint served on the GPU: quantize on CUDA, reload, and run prefill and greedy decode through
QuantLinear's W4A16 kernels, against the same checkpoint on the CPU in float32 (the plain-PyTorch reference)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err, tiny_llama_config, tiny_tokenizer

pytestmark = pytest.mark.gpu

# (hidden, intermediate, heads, kv heads), scheme: K multiples of 128 take the paired-nibble kernels (Gluon on
# Hopper); SmolLM2's 576 / 1536 widths leave a partial last group at g128 and take the other Triton kernels
CASES = {
    "paired-g128-asym": ((512, 1408, 8, 2), dict(group_size=128, sym=False), {}),
    "paired-g64-sym-act-order": ((512, 1408, 8, 2), dict(group_size=64, sym=True), {"desc_act": True, "static_groups": False}),
    "smollm2-widths-g128": ((576, 1536, 9, 3), dict(group_size=128, sym=False), {}),
}


@pytest.fixture
def kernel_calls(monkeypatch):
    """The W4A16 kernels the model's calls ran (recorded by the launchers bound at load) and how often a quantized
    linear fell back to the reference."""
    from quantkit.kernels import dispatch, w4a16

    calls = {"paths": [], "reference": 0}
    bind = w4a16.bind_launcher
    reference = dispatch.w4a16_matmul_ref

    def recording_bind(choice, facts, bucket):
        run = bind(choice, facts, bucket)
        if run is None:
            return None

        def recording_run(x, w):
            calls["paths"].append(choice.kernel)
            return run(x, w)

        return recording_run

    def counting_reference(*args, **kwargs):
        calls["reference"] += 1
        return reference(*args, **kwargs)

    def clear_bindings():  # launchers are memoized per layer shape: bind afresh under the recorder, and after it
        dispatch.bound_launchers.cache_clear()
        dispatch.planned.cache_clear()

    clear_bindings()
    monkeypatch.setattr(w4a16, "bind_launcher", recording_bind)
    monkeypatch.setattr(dispatch, "w4a16_matmul_ref", counting_reference)
    yield calls
    clear_bindings()


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_model_serves_through_the_kernels(case, tmp_path, tiny_text_file, kernel_calls):
    from transformers import LlamaForCausalLM

    import quantkit
    from quantkit import CalibConfig, QuantScheme
    from quantkit.config import LoadConfig

    (hidden, inter, heads, kv), scheme, options = CASES[case]
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter,
                                               num_attention_heads=heads, num_key_value_heads=kv))
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "w4"
    quantkit.quantize(str(folder), out, method="gptq", scheme=QuantScheme(bits=4, **scheme), method_options=options,
                      calib=CalibConfig(source=str(tiny_text_file), nsamples=8, seqlen=64),
                      load=LoadConfig(device="cuda"))

    served, _ = quantkit.load_quantized(out, device="cuda", dtype=torch.bfloat16)
    reference, _ = quantkit.load_quantized(out, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, len(tokenizer), (2, 48))
    with torch.no_grad():
        logits = served(ids.cuda()).logits.cpu()
        expected = reference(ids).logits
    assert rel_err(logits, expected) < 2e-2  # bf16 activations against float32

    # greedy decode: every step after the prompt is M = 1 through the kernels
    prompt = ids[:1, :16]
    with torch.no_grad():
        generated = served.generate(prompt.cuda(), max_new_tokens=6, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True, pad_token_id=0)
        steps = torch.stack([s[0].float().cpu() for s in generated.logits])  # [6, vocab]
        teacher = reference(generated.sequences.cpu()).logits[0, 15:21]
    assert rel_err(steps, teacher) < 2e-2

    assert kernel_calls["reference"] == 0, "a quantized linear fell back to the plain-PyTorch reference on CUDA"
    assert kernel_calls["paths"], "no call reached the W4A16 kernels"
    if torch.cuda.get_device_capability()[0] == 9 and hidden % 128 == 0:
        assert "gluon" in kernel_calls["paths"]  # prefill on Hopper takes the Gluon kernel
