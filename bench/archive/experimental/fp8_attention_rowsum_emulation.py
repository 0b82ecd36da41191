"""CPU float32 emulation of the fp8 ws attention kernel's math, on the inputs of tests/kernels/test_attention_gluon.py's
test_gluon_fp8 (run 15, bench/NOTES_attention.md): 128-key tiles of online softmax over the prepare_fp8 values, P
rounded to e4m3 for P @ V, and the row sums either from the fp32 P (the Triton fp8 kernel, the ws kernel before
rowsum_mma) or from the e4m3 P (what a P @ ones wgmma sums), with P computed times 2**p_log2. tau > 0 (run 17, lazy
rescale): a row's running max is only raised when a tile's max exceeds it by more than tau (log2 units), so P is
up to 2**(p_log2 + tau).

    TRITON_INTERPRET=1 python bench/fp8_attention_rowsum_emulation.py

Prints each variant's error against the float32 reference and against the fp32-sum, unscaled-P variant (the Triton
kernel's math, which the test bounds at 0.02)."""
import math

import torch

from quantkit.kernels.attention import attention_ref
from quantkit.kernels.attention_fp8 import prepare_fp8


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def emulate(q, k, v, cu, causal, e4m3_sums, p_log2=0.0, block_n=128, tau=0.0):
    q8, qs, k8, ks, _, vs = prepare_fp8(q, k, v, cu_seqlens_k=cu)
    vq = (v.float() / vs[None, :, None]).to(torch.float8_e4m3fn).float()  # the values of the kernel's V^T
    group, d = q.shape[1] // k.shape[1], q.shape[2]
    out = torch.zeros(q.shape)
    c = cu.tolist()
    for b in range(len(c) - 1):
        s0, n = c[b], c[b + 1] - c[b]
        for h in range(q.shape[1]):
            kh = h // group
            qq, kk, vv = q8[s0:s0 + n, h].float(), k8[s0:s0 + n, kh].float(), vq[s0:s0 + n, kh]
            scale = d ** -0.5 * math.log2(math.e) * qs[s0:s0 + n, h]
            m, row_sum, acc = torch.full((n,), -math.inf), torch.zeros(n), torch.zeros(n, d)
            for j in range(0, n, block_n):
                s = (qq @ kk[j:j + block_n].T) * (scale * ks[s0 + j, kh])[:, None]
                if causal:
                    s = torch.where(torch.arange(j, min(j + block_n, n))[None] <= torch.arange(n)[:, None], s, -math.inf)
                m_tile = s.max(1).values
                m_new = torch.where(m_tile > m + tau, m_tile, m) if tau > 0 else torch.maximum(m, m_tile)
                m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
                p, alpha = torch.exp2(s - m_safe[:, None] + p_log2), torch.exp2(m - m_safe)
                p8 = p.to(torch.float8_e4m3fn).float()
                row_sum = row_sum * alpha + (p8 if e4m3_sums else p).sum(1)
                acc = acc * alpha[:, None] + p8 @ vv[j:j + block_n]
                m = m_new
            out[s0:s0 + n, h] = acc / torch.where(row_sum == 0, 1.0, row_sum)[:, None] * vs[kh]
    return out


def main():
    gen = torch.Generator().manual_seed(8)  # test_gluon_fp8's inputs (K blocks scaled x0.5, x1, x2)
    lens = [1024, 96, 320]
    q, k, v = (torch.randn(sum(lens), h, 128, generator=gen).to(torch.bfloat16) for h in (8, 2, 2))
    local = torch.cat([torch.arange(n) for n in lens])
    k = k * (2.0 ** ((local // 128) % 3 - 1)).to(k.dtype)[:, None, None]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    for causal in (False, True):
        ref = attention_ref(q, k, v, cu, cu, causal=causal)
        base = emulate(q, k, v, cu, causal, False)
        for p_log2 in (0.0, 4.0, 8.0):
            for e4m3_sums in (False, True):
                o = emulate(q, k, v, cu, causal, e4m3_sums, p_log2)
                print(f"causal={int(causal)} P x 2^{p_log2:.0f} row sums of {'e4m3' if e4m3_sums else 'fp32'} P: "
                      f"vs reference {rel(o, ref):.4f}, vs fp32 sums of unscaled P {rel(o, base):.4f}")
        # lazy rescale: P up to 2^(p_log2 + tau) <= 256 with the e4m3 sums; tau 8 with fp32 sums (hd64's default)
        for p_log2, tau, e4m3_sums in ((6.0, 2.0, True), (5.0, 3.0, True), (0.0, 8.0, False)):
            o = emulate(q, k, v, cu, causal, e4m3_sums, p_log2, tau=tau)
            print(f"causal={int(causal)} lazy max tau {tau:.0f}, P x 2^{p_log2:.0f}, row sums of "
                  f"{'e4m3' if e4m3_sums else 'fp32'} P: vs reference {rel(o, ref):.4f}, "
                  f"vs fp32 sums of unscaled P {rel(o, base):.4f}")


if __name__ == "__main__":
    main()
