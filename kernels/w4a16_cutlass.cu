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
// describes). Weights: signed 4-bit codes (GPTQ's unsigned code - 8: its K-major words with every nibble XOR 8),
// two a byte, low nibble first. Scales: bf16 [K / group, N] (GPTQ's layout, N fastest). Optional zero term: bf16
// [K / group, N] added to code x scale (a GPTQ zero point z becomes (8 - z) x scale).
//
// QK_SHUFFLE (not built by the launcher, not measured): CUTLASS's reordered weight layout instead (each thread's
// values contiguous, nibbles in its converter's order), written once by qk_cutlass_reorder; its header pulls in
// curand, which not every toolkit has.
//
// Config (compile-time): QK_TILE_N x QK_TILE_M output tile (weight rows x activation rows), QK_CLUSTER_N CTAs of a
// cluster along the weight rows (they share each activation box by multicast), QK_PINGPONG (two consumer
// warpgroups on two tiles) or cooperative (both on one tile), QK_ZEROS (the zero term).

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
#ifndef QK_ZEROS
#define QK_ZEROS 0
#endif
#ifndef QK_SHUFFLE
#define QK_SHUFFLE 0
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
#if QK_SHUFFLE
#include "cutlass/util/mixed_dtype_utils.hpp"  // includes curand: only where the toolkit has it
#endif

using namespace cute;

namespace {

using MmaType = cutlass::bfloat16_t;
using CodeType = cutlass::int4b_t;
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

#if QK_SHUFFLE
// The reordered weight layout: one warp fragment's values contiguous, nibbles shuffled for the converter.
using ValueShuffle = Layout<Shape<_2, _4>, Stride<_4, _1>>;
using LayoutAtomCodes =
    decltype(cutlass::compute_memory_reordering_atom<MmaType, Layout<Shape<_1, _1>>, ValueShuffle>());
using LayoutW = decltype(cute::tile_to_shape(LayoutAtomCodes{}, Layout<Shape<int, int, int>, StrideW>{}));
#else
using LayoutW = cutlass::layout::RowMajor;
#endif

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, LayoutOut, 128 / cutlass::sizeof_bits<OutType>::value,  // no C operand: out = acc
    OutType, LayoutOut, 128 / cutlass::sizeof_bits<OutType>::value, EpilogueSchedule>::CollectiveOp;

#if QK_ZEROS
using WeightOperand = cute::tuple<CodeType, MmaType, MmaType>;  // codes, scales, zero terms
#else
using WeightOperand = cute::tuple<CodeType, MmaType>;  // codes, scales
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
  auto shape_w = make_shape(n, k, 1);
#if QK_SHUFFLE
  LayoutW layout_w = tile_to_shape(LayoutAtomCodes{}, shape_w);
#else
  StrideW layout_w = cutlass::make_cute_packed_stride(StrideW{}, shape_w);
#endif
  StrideX stride_x = cutlass::make_cute_packed_stride(StrideX{}, make_shape(m, k, 1));
  StrideScale stride_s = cutlass::make_cute_packed_stride(StrideScale{}, make_shape(n, k / group, 1));
  auto stride_out = cutlass::make_cute_packed_stride(typename GemmKernel::StrideD{}, make_shape(n, m, 1));
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {n, m, k, 1},
      {static_cast<const CodeType*>(codes), layout_w, static_cast<const MmaType*>(x), stride_x,
       static_cast<const MmaType*>(scales), stride_s, group
#if QK_ZEROS
       , static_cast<const MmaType*>(zero_terms)
#endif
      },
      {{1.0f, 0.0f}, nullptr, stride_out, static_cast<OutType*>(out), stride_out}};
  (void)zero_terms;
  return args;
}

}  // namespace

extern "C" {

// Whether the weights go through qk_cutlass_reorder before a call (1) or are used as GPTQ packs them (0).
int qk_cutlass_shuffled() { return QK_SHUFFLE; }

// The reordered copy of signed codes [n, k] (K-major, two a byte, low nibble first) into `dst` (same size).
int qk_cutlass_reorder(const void* src, void* dst, int n, int k) {
#if QK_SHUFFLE
  auto shape_w = make_shape(n, k, 1);
  auto layout_src = make_layout(shape_w, cutlass::make_cute_packed_stride(StrideW{}, shape_w));
  LayoutW layout_dst = tile_to_shape(LayoutAtomCodes{}, shape_w);
  // launches on the default stream and synchronizes
  cutlass::reorder_tensor(static_cast<const CodeType*>(src), layout_src, static_cast<CodeType*>(dst), layout_dst);
  return static_cast<int>(cudaGetLastError());
#else
  (void)src, (void)dst, (void)n, (void)k;
  return -1;  // nothing to reorder in this build
#endif
}

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
