// W4A16 decode GEMM for M <= 16 (sm_80+; tuned for sm_90): y[M, N] = x[M, K] @ dequant(W)^T, CUDA C++.
// Built on first use by kernels/w4a16_cuda.py (nvcc, one shared library per config, cached per machine) and
// launched through ctypes on the caller's stream. Plain-PyTorch reference: w4a16_weights.w4a16_matmul_ref.
//
// Reads the repacked layout of W4A16Weights (the Triton/Gluon kernels' own): qweight int32 [N, K / 8], K
// contiguous per row, code p of a word at bits 4p; scales fp16 [G, N]; zeros uint8 [G, N] or none (8);
// groups a multiple of 128 (one group per 128-code K tile). x in the caller's column order.
//
// Design (Little's law: the SM must keep ~25-30 KB of loads in flight):
// * A warp owns R blocks of 16 output rows; the W warps of a CTA share the rows and split K; each iteration a
//   warp issues every 128-bit load of U consecutive K tiles (2 * R * U LDG.128 of words per thread, 128 B per
//   row contiguous at U = 2) before it touches any of them: loads in flight per thread = 32 * R * U bytes.
// * mma.sync m16n8k16, weights as A: thread (g, t) reads physical words 4t .. 4t + 3 of rows g and g + 8 (one
//   LDG.128 each); a word shifted right by 4j has codes j and j + 4 at bits 0 and 16, so one lop3 makes the
//   pair (MAGIC + code) of 16-bit floats, an A register as it is. The activation pairs follow the same
//   relabelling (one prmt each), read from x's row g (and g + 8) in four 16-byte loads per K tile.
// * The magic offset and the zero point leave the float32 tile as (MAGIC + zero) * sum(x), the sums made by
//   eight more mma.sync with A = 1.0 per K tile (shared by the R blocks); then the group scale.
// * The W warps meet in shared memory; with SPLITS > 1 the CTAs of a row tile add float32 partial sums into
//   the zeroed workspace ws [M, N] and the last one (a counter per row tile) stores y and zeroes both again.
// * Programmatic dependent launch (QK_PDL builds, sm_90+, launched with the attribute): the kernel may start
//   while the previous one (the norm that wrote x) finishes; meanwhile it asks its first batch of weight words
//   into L2 (prefetch.global.L2: constants), then waits for that grid (griddepcontrol.wait) before its first load
//   and lets the next kernel launch at once (which waits in turn), as quantkit's Triton kernels do. Other builds
//   carry none of these instructions.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#ifndef QK_PDL
#define QK_PDL 0      // 1: wait for the previous grid (programmatic dependent launch)
#endif
#ifndef QK_R
#define QK_R 2        // row blocks of 16 per warp
#endif
#ifndef QK_U
#define QK_U 2        // K tiles of 128 per load batch
#endif
#ifndef QK_W
#define QK_W 4        // warps per CTA (split K inside the CTA)
#endif
#ifndef QK_MT
#define QK_MT 1       // n8 activation tiles: 1 for M <= 8, 2 for M <= 16
#endif
#ifndef QK_BF16
#define QK_BF16 1     // activations bf16 (else fp16)
#endif
#ifndef QK_ZEROS
#define QK_ZEROS 0    // asymmetric: uint8 zero points
#endif
#ifndef QK_L2_256
#define QK_L2_256 0   // L2::256B prefetch hint on the weight loads
#endif

#if QK_BF16
typedef __nv_bfloat16 act_t;
#define QK_MAGIC 0x43004300u     // bf16 pair 128.0: 128 + code is exact (7 mantissa bits)
#define QK_MAGIC_F 128.0f
#define QK_ONES 0x3F803F80u      // bf16 pair 1.0
#define QK_MMA "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#else
typedef __half act_t;
#define QK_MAGIC 0x64006400u     // fp16 pair 1024.0
#define QK_MAGIC_F 1024.0f
#define QK_ONES 0x3C003C00u
#define QK_MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#endif

#define QK_ROWS (16 * QK_R)

__device__ __forceinline__ uint4 ld_words(const uint32_t* p, bool ok) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
#if QK_L2_256
  asm volatile("{ .reg .pred q; setp.ne.b32 q, %5, 0;\n"
               " @q ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4]; }"
               : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w) : "l"(p), "r"((int)ok));
#else
  asm volatile("{ .reg .pred q; setp.ne.b32 q, %5, 0;\n"
               " @q ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4]; }"
               : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w) : "l"(p), "r"((int)ok));
#endif
  return v;
}

__device__ __forceinline__ uint4 ld_x(const act_t* p, bool ok) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  asm volatile("{ .reg .pred q; setp.ne.b32 q, %5, 0;\n"
               " @q ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4]; }"
               : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w) : "l"(p), "r"((int)ok));
  return v;
}

__device__ __forceinline__ uint32_t magic_pair(uint32_t shifted) {
  uint32_t r;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(r) : "r"(shifted), "n"(QK_MAGIC));
  return r;
}

__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm(QK_MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float act_to_float(uint16_t bits) {
#if QK_BF16
  return __uint_as_float(((uint32_t)bits) << 16);
#else
  return __half2float(__ushort_as_half(bits));
#endif
}

// The activation pairs of one K tile, row tile mt: X[4i + j] = (x[32t + 8i + j], x[32t + 8i + j + 4]).
__device__ __forceinline__ void x_pairs(const uint4* raw, uint32_t* xp) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t v[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};  // elements 8i .. 8i + 7
    xp[4 * i + 0] = __byte_perm(v[0], v[2], 0x5410);
    xp[4 * i + 1] = __byte_perm(v[0], v[2], 0x7632);
    xp[4 * i + 2] = __byte_perm(v[1], v[3], 0x5410);
    xp[4 * i + 3] = __byte_perm(v[1], v[3], 0x7632);
  }
}

extern "C" __global__ void __launch_bounds__(QK_W * 32)
w4a16_decode(const uint32_t* __restrict__ qw, const act_t* __restrict__ x, const __half* __restrict__ scales,
             const uint8_t* __restrict__ zeros, act_t* __restrict__ y, float* __restrict__ ws,
             int* __restrict__ counters, int M, int N, int k_tiles, int tiles_per_split, int stride_wn,
             int stride_xm, int stride_sg, int stride_zg, int group_tiles) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * QK_ROWS;
  const int kt_lo = blockIdx.y * tiles_per_split;
  const int kt_hi = min(k_tiles, kt_lo + tiles_per_split);

  float acc[QK_R][QK_MT][4];
#pragma unroll
  for (int r = 0; r < QK_R; ++r)
#pragma unroll
    for (int mt = 0; mt < QK_MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][mt][e] = 0.f;

  // this thread's rows: block r, half h -> row0 + 16r + g + 8h
  const uint32_t* wrow[QK_R][2];
  bool row_ok[QK_R][2];
#pragma unroll
  for (int r = 0; r < QK_R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = row0 + 16 * r + g + 8 * h;
      row_ok[r][h] = n < N;
      wrow[r][h] = qw + (size_t)min(n, N - 1) * stride_wn + 4 * t;
    }
  bool m_ok[QK_MT];
  const act_t* xrow[QK_MT];
#pragma unroll
  for (int mt = 0; mt < QK_MT; ++mt) {
    const int m = 8 * mt + g;
    m_ok[mt] = m < M;
    xrow[mt] = x + (size_t)min(m, M - 1) * stride_xm + 32 * t;
  }

  // advance the row pointers by a batch stride instead of indexing (fewer 64-bit address computations)
#pragma unroll
  for (int r = 0; r < QK_R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) wrow[r][h] += 16 * (kt_lo + warp * QK_U);
#pragma unroll
  for (int mt = 0; mt < QK_MT; ++mt) xrow[mt] += 128 * (kt_lo + warp * QK_U);
#if QK_PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // everything above is address arithmetic. The weights are constants: the first batch's words are asked into L2
  // while the previous kernel finishes; from the wait on, memory it wrote is read (x, the workspace, the counters)
  if (kt_lo + warp * QK_U < kt_hi) {
#pragma unroll
    for (int u = 0; u < QK_U; ++u)
#pragma unroll
      for (int r = 0; r < QK_R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (row_ok[r][h] && kt_lo + warp * QK_U + u < kt_hi)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(wrow[r][h] + 16 * u));
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  for (int base = kt_lo + warp * QK_U; base < kt_hi; base += QK_W * QK_U) {
    // every load of the batch first: U tiles x R blocks x 2 rows of words, and U tiles of activations
    uint4 wv[QK_U][QK_R][2];
    uint4 xv[QK_U][QK_MT][4];
#pragma unroll
    for (int u = 0; u < QK_U; ++u) {
      const int kt = base + u;
      const bool k_ok = kt < kt_hi;
#pragma unroll
      for (int r = 0; r < QK_R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][r][h] = ld_words(wrow[r][h] + 16 * u, k_ok && row_ok[r][h]);
#pragma unroll
      for (int mt = 0; mt < QK_MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) xv[u][mt][i] = ld_x(xrow[mt] + 128 * u + 8 * i, k_ok && m_ok[mt]);
    }
#pragma unroll
    for (int r = 0; r < QK_R; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) wrow[r][h] += 16 * QK_W * QK_U;
#pragma unroll
    for (int mt = 0; mt < QK_MT; ++mt) xrow[mt] += 128 * QK_W * QK_U;
#pragma unroll
    for (int u = 0; u < QK_U; ++u) {
      const int kt = base + u;
      if (kt >= kt_hi) break;
      const int grp = kt / group_tiles;
      uint32_t xp[QK_MT][16];
      float xsum[QK_MT][4];
#pragma unroll
      for (int mt = 0; mt < QK_MT; ++mt) {
        x_pairs(xv[u][mt], xp[mt]);
#pragma unroll
        for (int e = 0; e < 4; ++e) xsum[mt][e] = 0.f;
#pragma unroll
        for (int s = 0; s < 8; ++s) mma(xsum[mt], QK_ONES, QK_ONES, QK_ONES, QK_ONES, xp[mt][2 * s], xp[mt][2 * s + 1]);
      }
#pragma unroll
      for (int r = 0; r < QK_R; ++r) {
        uint32_t pa[16], pb[16];  // pair 4i + j of rows g and g + 8
        const uint32_t wa[4] = {wv[u][r][0].x, wv[u][r][0].y, wv[u][r][0].z, wv[u][r][0].w};
        const uint32_t wb[4] = {wv[u][r][1].x, wv[u][r][1].y, wv[u][r][1].z, wv[u][r][1].w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            pa[4 * i + j] = magic_pair(wa[i] >> (4 * j));
            pb[4 * i + j] = magic_pair(wb[i] >> (4 * j));
          }
        float sc[2], bias[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int n = min(row0 + 16 * r + g + 8 * h, N - 1);
          sc[h] = __half2float(scales[(size_t)grp * stride_sg + n]);
#if QK_ZEROS
          bias[h] = QK_MAGIC_F + (float)zeros[(size_t)grp * stride_zg + n];
#else
          bias[h] = QK_MAGIC_F + 8.f;
#endif
        }
#pragma unroll
        for (int mt = 0; mt < QK_MT; ++mt) {
          float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int s = 0; s < 8; ++s)
            mma(part, pa[2 * s], pb[2 * s], pa[2 * s + 1], pb[2 * s + 1], xp[mt][2 * s], xp[mt][2 * s + 1]);
          // c0, c1: row g (activation rows 2t, 2t + 1); c2, c3: row g + 8
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc[r][mt][e] += sc[e >> 1] * (part[e] - bias[e >> 1] * xsum[mt][e]);
        }
      }
    }
  }

  // the W warps' sums meet in shared memory
  constexpr int PER_LANE = QK_R * QK_MT * 4;
  __shared__ float red[QK_W > 1 ? QK_W - 1 : 1][PER_LANE][32];
  if (QK_W > 1 && warp > 0) {
#pragma unroll
    for (int r = 0; r < QK_R; ++r)
#pragma unroll
      for (int mt = 0; mt < QK_MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[warp - 1][(r * QK_MT + mt) * 4 + e][lane] = acc[r][mt][e];
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int w = 1; w < QK_W; ++w)
#pragma unroll
    for (int r = 0; r < QK_R; ++r)
#pragma unroll
      for (int mt = 0; mt < QK_MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][mt][e] += red[w - 1][(r * QK_MT + mt) * 4 + e][lane];

  const bool split = gridDim.y > 1;
#pragma unroll
  for (int r = 0; r < QK_R; ++r)
#pragma unroll
    for (int mt = 0; mt < QK_MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int n = row0 + 16 * r + g + 8 * (e >> 1), m = 8 * mt + 2 * t + (e & 1);
        if (n < N && m < M) {
          if (split) atomicAdd(ws + (size_t)m * N + n, acc[r][mt][e]);
          else y[(size_t)m * N + n] = (act_t)acc[r][mt][e];
        }
      }
  if (!split) return;
  // the last CTA of the row tile stores it and leaves workspace and counter zeroed (split-K semaphore)
  __threadfence();
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(counters + blockIdx.x, 1) == (int)gridDim.y - 1;
  last = __shfl_sync(0xffffffffu, last, 0);
  if (!last) return;
  __threadfence();
  for (int i = lane; i < QK_ROWS * M; i += 32) {
    const int m = i / QK_ROWS, n = row0 + i % QK_ROWS;
    if (n < N) {
      float* p = ws + (size_t)m * N + n;
      y[(size_t)m * N + n] = (act_t)__ldcg(p);
      *p = 0.f;
    }
  }
  if (lane == 0) counters[blockIdx.x] = 0;
}

// Host entry (ctypes): launches on ``stream`` (with programmatic dependent launch where ``pdl``) and returns the
// launch's cudaError_t.
extern "C" int qk_w4a16_decode_launch(const void* qw, const void* x, const void* scales, const void* zeros, void* y,
                                      void* ws, void* counters, int M, int N, int k_tiles, int splits,
                                      int stride_wn, int stride_xm, int stride_sg, int stride_zg, int group_tiles,
                                      int pdl, void* stream) {
  const int tiles_per_split = (k_tiles + splits - 1) / splits;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((N + QK_ROWS - 1) / QK_ROWS, splits);
  config.blockDim = dim3(QK_W * 32);
  config.dynamicSmemBytes = 0;
  config.stream = (cudaStream_t)stream;
  // with no attribute this is the plain launch (what <<<grid, block, 0, stream>>> does)
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  return (int)cudaLaunchKernelEx(&config, w4a16_decode, (const uint32_t*)qw, (const act_t*)x, (const __half*)scales,
                                 (const uint8_t*)zeros, (act_t*)y, (float*)ws, (int*)counters, M, N, k_tiles,
                                 tiles_per_split, stride_wn, stride_xm, stride_sg, stride_zg, group_tiles);
}

// CTAs of this config resident per SM (registers, shared memory), for sizing the K split.
extern "C" int qk_w4a16_decode_occupancy() {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, w4a16_decode, QK_W * 32, 0) != cudaSuccess) return -1;
  return blocks;
}
