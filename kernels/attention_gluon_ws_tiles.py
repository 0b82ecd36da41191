"""What both partitions of the warp-specialized Gluon attention kernel (:mod:`quantkit.kernels.attention_gluon_ws`)
share: the query rows per consumer warpgroup, the register and shared layouts of the staged K scales and of the
ones tile, and the order in which a persistent program takes its work tiles (:func:`_tile_coords`).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

HALF_M = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M)

# STAGE_KS: the producer's 4 warps hold a K scale as HALF_M copies and store them to a plain shared row;
# each consumer reads the copies of its own rows (the S rows' layout)
KS_REG_LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
KS_SMEM_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
# ROWSUM_MMA: N of the P @ ones wgmma (the smallest) and the layout the 4 pre-partition warps write ones from
ONES_N = gl.constexpr(8)
ONES_REG_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0]))


@gluon.jit
def _tile_coords(k, cu_seqlens_q_ptr, cu_seqlens_k_ptr, NUM_M_BLOCKS, N_SEQ, N_WORK, SWIZZLE,
                 GROUP: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """This program's k-th work tile -> (q_start, seqlen_q, kv_start, seqlen_k, blk_m0, head, kv_head, n_tiles);
    n_tiles < 0: nothing to do (past the last tile, or a query block past its sequence's end).

    Order: groups of SWIZZLE (sequence, head) pairs, query block slowest inside a group, heaviest first. Round k
    hands tiles k * P .. k * P + P - 1 to the P programs, reversed on odd rounds (zigzag), which evens out the
    causal work per program. SWIZZLE = 1 keeps concurrent programs on a few K/V heads (L2); the launcher raises
    it to all pairs when one head's query blocks alone would fill the machine."""
    n_prog = gl.num_programs(0)
    pid = gl.program_id(0)
    t = k * n_prog + pid + (k % 2) * (n_prog - 1 - 2 * pid)
    valid = t < N_WORK
    t = gl.minimum(t, N_WORK - 1)
    n_pairs = N_WORK // NUM_M_BLOCKS
    grp = t // (SWIZZLE * NUM_M_BLOCKS)
    size = gl.minimum(n_pairs - grp * SWIZZLE, SWIZZLE)
    r = t - grp * SWIZZLE * NUM_M_BLOCKS
    pid_m = NUM_M_BLOCKS - 1 - r // size
    pair = grp * SWIZZLE + r % size
    seq = pair % N_SEQ
    head = pair // N_SEQ
    q_start = gl.load(cu_seqlens_q_ptr + seq)
    seqlen_q = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    kv_start = gl.load(cu_seqlens_k_ptr + seq)
    seqlen_k = gl.load(cu_seqlens_k_ptr + seq + 1) - kv_start
    blk_m0 = pid_m * (2 * HALF_M)
    # key tiles of the whole 128-row block: the ping-pong needs both warpgroups to run the same rounds;
    # tiles a half does not see are masked by its softmax
    hi = seqlen_k
    if IS_CAUSAL:
        hi = gl.minimum(seqlen_k, blk_m0 + 2 * HALF_M + seqlen_k - seqlen_q)
    n_tiles = (gl.maximum(hi, 0) + BLOCK_N - 1) // BLOCK_N
    if blk_m0 >= seqlen_q or not valid:
        n_tiles = -1
    return q_start, seqlen_q, kv_start, seqlen_k, blk_m0, head, head // GROUP, n_tiles
