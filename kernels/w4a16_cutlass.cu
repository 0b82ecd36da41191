// The W4A16 prefill GEMM on Hopper through CUTLASS's mixed-input collective (the CUTLASS headers of the
// `nvidia-cutlass` package), built by kernels/w4a16_cutlass.py on first use.
//
// Why CUTLASS: the Gluon wgmma kernel reaches 0.7-0.9x cuBLAS at M >= 256 and is bound by each CTA re-reading
// its activation block from L2 (bench/archive/NOTES_w4a16.md, run 29); sharing those boxes between the CTAs of a
// cluster (TMA multicast) is what cuBLAS does and what Gluon 3.6 cannot express. CUTLASS's Hopper mainloop for
// mixed inputs has clusters, multicast and warp-specialized schedules, with the narrow operand upcast in registers.
//
// The product is computed transposed, out^T [N, M] = W [N, K] . x^T, so the 4-bit weights are the register (A)
// operand and the output is written by the TMA epilogue as out [M, N] row-major (the swap the CUTLASS example 55
// describes). Weights: GPTQ's unsigned 4-bit codes as the runtime keeps them (K-major int32 words, eight codes a
// word, low nibble first), read in place. Scales: bf16 [K / group, N] (GPTQ's layout, N fastest). Zero terms: bf16
// [K / group, N], -zero x scale (zero 8 where symmetric), added to code x scale: CUTLASS's scale-and-zero mode,
// so the weights need no signed copy.
//
// QK_SIGNED (bench only, bench_w4a16_prefill.py): the build of the first measurements instead: signed codes
// (code - 8, every nibble XOR 8, a copy of the weights) and scales alone, symmetric layers only.
//
// Config (compile-time): QK_TILE_N x QK_TILE_M output tile (weight rows x activation rows), QK_CLUSTER_N CTAs of a
// cluster along the weight rows (they share each activation box by multicast), QK_PINGPONG (two consumer
// warpgroups on two tiles) or cooperative (both on one tile).

#ifndef QK_TILE_N
#define QK_TILE_N 128
#endif
#ifndef QK_TILE_M
#define QK_TILE_M 128
#endif
#ifndef QK_CLUSTER_N
#define QK_CLUSTER_N 1
#endif
#ifndef QK_PINGPONG
#define QK_PINGPONG 0
#endif
#ifndef QK_SIGNED
#define QK_SIGNED 0
#endif

#include <cstdint>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

namespace {

using MmaType = cutlass::bfloat16_t;
#if QK_SIGNED
using CodeType = cutlass::int4b_t;
#else
using CodeType = cutlass::uint4b_t;
#endif
using OutType = cutlass::bfloat16_t;
constexpr int kTileK = 64;  // 128 bytes of 16-bit activations a row: one TMA box row, one 128-byte swizzle

using TileShape = Shape<Int<QK_TILE_N>, Int<QK_TILE_M>, Int<kTileK>>;
using ClusterShape = Shape<Int<QK_CLUSTER_N>, _1, _1>;
#if QK_PINGPONG
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
#else
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif

// Weights [N, K], K contiguous: the row-major A of the transposed product.
using StrideW = cutlass::detail::TagToStrideA_t<cutlass::layout::RowMajor>;
// Activations [M, K] row-major: the transposed product's column-major B [K, M].
using LayoutX = cutlass::layout::ColumnMajor;
using StrideX = cutlass::detail::TagToStrideB_t<LayoutX>;
// out [M, N] row-major is out^T [N, M] column-major.
using LayoutOut = cutlass::layout::ColumnMajor;

using LayoutW = cutlass::layout::RowMajor;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, LayoutOut, 128 / cutlass::sizeof_bits<OutType>::value,  // no C operand: out = acc
    OutType, LayoutOut, 128 / cutlass::sizeof_bits<OutType>::value, EpilogueSchedule>::CollectiveOp;

#if QK_SIGNED
using WeightOperand = cute::tuple<CodeType, MmaType>;  // codes, scales
#else
using WeightOperand = cute::tuple<CodeType, MmaType, MmaType>;  // codes, scales, zero terms
#endif

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    WeightOperand, LayoutW, 128 / cutlass::sizeof_bits<CodeType>::value,
    MmaType, LayoutX, 128 / cutlass::sizeof_bits<MmaType>::value,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    MainloopSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                        CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideScale = typename CollectiveMainloop::StrideScale;

typename Gemm::Arguments arguments(const void* codes, const void* x, const void* scales, const void* zero_terms,
                                   void* out, int m, int n, int k, int group) {
  StrideW stride_w = cutlass::make_cute_packed_stride(StrideW{}, make_shape(n, k, 1));
  StrideX stride_x = cutlass::make_cute_packed_stride(StrideX{}, make_shape(m, k, 1));
  StrideScale stride_s = cutlass::make_cute_packed_stride(StrideScale{}, make_shape(n, k / group, 1));
  auto stride_out = cutlass::make_cute_packed_stride(typename GemmKernel::StrideD{}, make_shape(n, m, 1));
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {n, m, k, 1},
      {static_cast<const CodeType*>(codes), stride_w, static_cast<const MmaType*>(x), stride_x,
       static_cast<const MmaType*>(scales), stride_s, group
#if !QK_SIGNED
       , static_cast<const MmaType*>(zero_terms)
#endif
      },
      {{1.0f, 0.0f}, nullptr, stride_out, static_cast<OutType*>(out), stride_out}};
  (void)zero_terms;
  return args;
}

}  // namespace

extern "C" {

// Bytes of device workspace a call of this shape needs (0 for these schedules; asked all the same).
long long qk_cutlass_workspace(int m, int n, int k, int group) {
  auto args = arguments(nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k, group);
  return static_cast<long long>(Gemm::get_workspace_size(args));
}

// out [m, n] bf16 = x [m, k] bf16 . dequant(codes)^T on `stream`; 0 on success, else a cutlass::Status code
// (+2000: the shape or operands refused by can_implement; +1000: a CUDA error after the launch).
int qk_cutlass_gemm(const void* codes, const void* x, const void* scales, const void* zero_terms, void* out,
                    int m, int n, int k, int group, void* workspace, void* stream) {
  auto args = arguments(codes, x, scales, zero_terms, out, m, n, k, group);
  // alignment, group against the K tile, the operands of the zero-point mode (+2000: refused before any launch)
  cutlass::Status status = Gemm::can_implement(args);
  if (status != cutlass::Status::kSuccess) return 2000 + static_cast<int>(status);
  Gemm gemm;
  auto s = static_cast<cudaStream_t>(stream);
  status = gemm.initialize(args, workspace, s);
  if (status != cutlass::Status::kSuccess) return static_cast<int>(status);
  status = gemm.run(s);
  if (status != cutlass::Status::kSuccess) return static_cast<int>(status);
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : 1000 + static_cast<int>(err);
}

}  // extern "C"
