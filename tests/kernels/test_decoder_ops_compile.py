"""The decoder step's small Triton kernels compiled for Hopper on the CPU (the interpreter runs no compiler):
the q/k norm, whose segment length and weights come from a branch on the program id, and the shared expert's
gated sum."""

from __future__ import annotations

import pytest
import triton


@pytest.mark.parametrize(("n_q", "seg_q", "seg_k"), [(32, 128, 128), (1, 2048, 512)])
def test_qk_norm_compiles_for_sm90_without_spills(sm90, tmp_path, n_q, seg_q, seg_k):
    """Per head (Qwen3-30B-A3B: 32 q heads of 128) and over the whole projections (OLMoE: q 2048, k 512), with PDL
    as launched on Hopper."""
    block = triton.next_power_of_2(max(seg_q, seg_k))
    signature = {"qkv_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "stride_t": "i32", "eps": "fp32",
                 "offset": "fp32"}
    ptx = sm90.triton_ptx(str(tmp_path / "qk_norm.ptx"), "quantkit.kernels.decoder_ops", "_qk_norm_kernel",
                          signature, dict(N_Q=n_q, SEG_Q=seg_q, SEG_K=seg_k, BLOCK=block, PDL=True),
                          num_warps=1 if block <= 256 else 4)
    notices = sm90.ptxas_notices(ptx)
    assert "0 bytes spill stores" in notices, notices
    text = open(ptx).read()  # PDL, as launched on Hopper: the next kernel may launch before this one waits
    assert 0 <= text.find("griddepcontrol.launch_dependents") < text.find("griddepcontrol.wait")


@pytest.mark.parametrize("h", [2048, 3584])  # Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B
def test_add_sigmoid_gated_compiles_for_sm90_without_spills(sm90, tmp_path, h):
    signature = {"y_ptr": "*bf16", "s_ptr": "*bf16", "x_ptr": "*bf16", "g_ptr": "*bf16", "out_ptr": "*bf16",
                 "H": "i32", "stride_y": "i32", "stride_s": "i32", "stride_x": "i32", "stride_o": "i32"}
    constexprs = dict(BLOCK_H=triton.next_power_of_2(h), BLOCK=min(1024, triton.next_power_of_2(h)))
    ptx = sm90.triton_ptx(str(tmp_path / "gated.ptx"), "quantkit.kernels.decoder_ops", "_add_sigmoid_gated_kernel",
                          signature, constexprs, num_warps=4)
    notices = sm90.ptxas_notices(ptx)
    assert "0 bytes spill stores" in notices, notices


@pytest.mark.parametrize("h", [4096, 8192])  # Llama-3-8B, -70B
def test_add_rms_norm_fp8_compiles_for_sm90_without_spills(sm90, tmp_path, h):
    """The norm that writes e4m3 codes and the row's scale (QUANT) for the FP8 linear behind it."""
    signature = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp8e4nv", "res_out_ptr": "*bf16",
                 "s_ptr": "*fp32", "static_ptr": "*fp32", "H": "i32", "eps": "fp32", "offset": "fp32",
                 "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32"}
    constexprs = dict(HAS_RES=True, BLOCK=triton.next_power_of_2(h), PDL=True, QUANT=True, STATIC=False)
    ptx = sm90.triton_ptx(str(tmp_path / "norm_fp8.ptx"), "quantkit.kernels.decoder_ops", "_add_rms_norm_kernel",
                          signature, constexprs, num_warps=4 if h <= 4096 else 8)
    notices = sm90.ptxas_notices(ptx)
    assert "0 bytes spill stores" in notices, notices


@pytest.mark.parametrize("inter", [14336, 16384])  # Llama-3-8B's intermediate; the longest row held whole
def test_act_mul_fp8_compiles_for_sm90_without_spills(sm90, tmp_path, inter):
    signature = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "s_ptr": "*fp32", "static_ptr": "*fp32", "inter": "i32",
                 "stride_x": "i32", "stride_o": "i32"}
    constexprs = dict(GELU=False, BLOCK=triton.next_power_of_2(inter), PDL=True, QUANT=True, STATIC=False)
    ptx = sm90.triton_ptx(str(tmp_path / "act_fp8.ptx"), "quantkit.kernels.decoder_ops", "_act_mul_kernel",
                          signature, constexprs, num_warps=16)
    notices = sm90.ptxas_notices(ptx)
    assert "0 bytes spill stores" in notices, notices


@pytest.mark.parametrize("qk_norm", [False, True])
def test_decode_attention_with_the_qk_norm_compiles_for_sm90_without_spills(sm90, tmp_path, qk_norm):
    """The fused decode attention at Qwen3-30B-A3B's heads (group 8, head dim 128, the launcher's tiles), with the
    per-head q/k norm inside (QK_NORM) and without."""
    signature = {"qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i32", "slots_ptr": "*i32",
                 "k_ptr": "*bf16", "v_ptr": "*bf16", "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32",
                 "out_ptr": "*bf16", "counter_ptr": "*i32", "qw_ptr": "*fp32", "kw_ptr": "*fp32", "sm_scale": "fp32",
                 "window_left": "i32", "softcap": "fp32", "norm_eps": "fp32", "norm_offset": "fp32",
                 "stride_qkv": "i32", "stride_cos": "i32", "stride_kb": "i32", "stride_kn": "i32", "stride_kh": "i32",
                 "stride_out": "i32"}
    constexprs = dict(N_HEADS=32, N_KV=4, GROUP=8, HALF=64, NUM_SPLITS=16, MIN_SPLIT_KEYS=256, BLOCK_M=16,
                      BLOCK_N=64, ROPE=True, HAS_WINDOW=False, HAS_SOFTCAP=False, PDL=True, GROUP_P2=8, SPLITS_P2=16,
                      SPLIT_BLOCK=8, QK_NORM=qk_norm)
    aligned = [name for name, ty in signature.items() if ty.startswith("*")] + [
        "stride_qkv", "stride_cos", "stride_kb", "stride_kn", "stride_kh", "stride_out"]  # as the launcher specializes
    ptx = sm90.triton_ptx(str(tmp_path / "decode.ptx"), "quantkit.kernels.decode_attention", "_decode_rope_kernel",
                          signature, constexprs, num_warps=4, aligned=tuple(aligned))
    notices = sm90.ptxas_notices(ptx)
    assert "0 bytes spill stores" in notices, notices
