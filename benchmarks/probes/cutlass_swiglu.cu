// The gate-up product through CUTLASS 3.x's Hopper GEMM (TMA, warp-specialised cooperative kernel,
// 2 x 1 clusters), optionally with SiLU-and-mul in its epilogue: D = A[M, K] @ W[N, K]^T, bf16 in and
// out, fp32 accumulation. Built by benchmarks/probes/cutlass_swiglu.py with nvcc, one variant a build:
//   TILE_N   128 or 256 (tiles are 128 x TILE_N x 64)
//   STREAM_K 0: persistent tile scheduler; 1: stream-K
//   EPI      0: CUTLASS's TMA epilogue, D [M, N]
//            1: SiLU-and-mul, each thread storing its output pairs to D [M, N / 2]
//            2: the same through a shared-memory stage and 16-byte stores
// For EPI 1 and 2 the weight is [gate; up] re-laid in blocks of TILE_N / 2 rows (gate block b, then up
// block b), so a tile holds TILE_N / 2 gate columns and their up columns: in the wgmma accumulator
// layout each thread's fragment holds a gate value and its up value half a fragment apart (the kernel
// checks this and raises *bad where not). The activation rounds as prefixserve's silu_mul does: both
// products to bf16, the SiLU to bf16, then the product.
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

using Elem = cutlass::bfloat16_t;
using TileShape = Shape<_128, Int<TILE_N>, _64>;
using ClusterShape = Shape<_2, _1, _1>;
using StrideA = cutlass::detail::TagToStrideA_t<cutlass::layout::RowMajor>;
using StrideB = cutlass::detail::TagToStrideB_t<cutlass::layout::ColumnMajor>;
using StrideOut = cutlass::detail::TagToStrideC_t<cutlass::layout::RowMajor>;
using Scheduler = cute::conditional_t<STREAM_K, cutlass::gemm::StreamKScheduler, cutlass::gemm::PersistentScheduler>;

struct SwiGluEpilogue {
  using EpilogueSchedule = cutlass::gemm::EpilogueDefault;
  using DispatchPolicy = EpilogueSchedule;
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<Elem, 1, float, float>;
  using ElementOutput = Elem;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementC = void;
  using ElementD = Elem;
  using GmemElementC = Elem;
  using StrideC = StrideOut;
  using StrideD = StrideOut;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  static constexpr int BM = size<0>(TileShape{});
  static constexpr int HALF = TILE_N / 2;
  struct SharedStorage {
#if EPI == 2
    alignas(128) Elem stage[BM][HALF + 8];
#endif
  };
  using TensorStorage = SharedStorage;
  struct Arguments {
    Elem* ptr_D = nullptr;  // [M, N / 2]
    int ldd = 0;
    int* bad = nullptr;
  };
  using Params = Arguments;
  static constexpr int kBarrier = int(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier) + 2;

  template <class P> static constexpr Params to_underlying_arguments(P const&, Arguments const& a, void*) { return a; }
  template <class P> static size_t get_workspace_size(P const&, Arguments const&) { return 0; }
  template <class P>
  static cutlass::Status initialize_workspace(P const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class P> static bool can_implement(P const&, Arguments const&) { return true; }

  CUTLASS_HOST_DEVICE SwiGluEpilogue(Params const& p, SharedStorage const& = SharedStorage()) : params(p) {}
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK, BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& acc, TiledMma tiled_mma, ResidueMNK,
                                 int thread_idx, char* smem) {
    constexpr int NV = decltype(size(acc))::value;
    constexpr int THREADS = decltype(size(TiledMma{}))::value;
    int M = get<0>(problem_shape_mnkl);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    Tensor coords = tiled_mma.get_thread_slice(thread_idx).partition_C(make_identity_tensor(Shape<Int<BM>, Int<TILE_N>>{}));
    int m0 = int(m_coord) * BM, c0 = int(n_coord) * HALF;
#if EPI == 2
    auto* storage = reinterpret_cast<SharedStorage*>(smem);
    cutlass::arch::NamedBarrier::sync(THREADS, kBarrier);  // the tile before has read its stage out
#endif
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < NV / 2; i += 2) {
      int r = get<0>(coords(i)), c = get<1>(coords(i));
      if (get<0>(coords(i + NV / 2)) != r || get<1>(coords(i + NV / 2)) != c + HALF || get<0>(coords(i + 1)) != r ||
          get<1>(coords(i + 1)) != c + 1) {
        *params.bad = 1;
      }
      Elem out[2];
      CUTLASS_PRAGMA_UNROLL
      for (int t = 0; t < 2; ++t) {
        float g = float(Elem(acc(i + t)));
        float u = float(Elem(acc(i + t + NV / 2)));
        out[t] = Elem(float(Elem(g / (1.0f + expf(-g)))) * u);
      }
#if EPI == 2
      *reinterpret_cast<uint32_t*>(&storage->stage[r][c]) = *reinterpret_cast<uint32_t*>(out);
#else
      if (m0 + r < M) {
        *reinterpret_cast<uint32_t*>(params.ptr_D + size_t(m0 + r) * params.ldd + c0 + c) =
            *reinterpret_cast<uint32_t*>(out);
      }
#endif
    }
#if EPI == 2
    cutlass::arch::NamedBarrier::sync(THREADS, kBarrier);
    constexpr int CHUNKS = HALF * 2 / 16;  // 16-byte chunks a row
    CUTLASS_PRAGMA_UNROLL
    for (int q = thread_idx; q < BM * CHUNKS; q += THREADS) {
      int r = q / CHUNKS, ch = q % CHUNKS;
      if (m0 + r < M) {
        *reinterpret_cast<uint4*>(params.ptr_D + size_t(m0 + r) * params.ldd + c0 + ch * 8) =
            *reinterpret_cast<uint4 const*>(&storage->stage[r][ch * 8]);
      }
    }
#endif
  }

  Params params;
};

#if EPI == 0
using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 8, Elem,
    cutlass::layout::RowMajor, 8, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
#else
using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<SwiGluEpilogue>;
#endif

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elem, cutlass::layout::RowMajor, 8, Elem,
    cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

static typename Gemm::Arguments arguments(int M, int N, int K, const void* A, const void* B, void* D, int* bad) {
  static int sms = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
  auto sA = cutlass::make_cute_packed_stride(StrideA{}, {M, K, 1});
  auto sB = cutlass::make_cute_packed_stride(StrideB{}, {N, K, 1});
#if EPI == 0
  auto sD = cutlass::make_cute_packed_stride(StrideOut{}, {M, N, 1});
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1},
                                {static_cast<const Elem*>(A), sA, static_cast<const Elem*>(B), sB},
                                {{1.0f, 0.0f}, nullptr, sD, static_cast<Elem*>(D), sD}};
#else
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {M, N, K, 1},
                                {static_cast<const Elem*>(A), sA, static_cast<const Elem*>(B), sB},
                                {static_cast<Elem*>(D), N / 2, bad}};
#endif
  args.hw_info.device_id = 0;
  args.hw_info.sm_count = sms;
  return args;
}

extern "C" size_t workspace_bytes(int M, int N, int K) {
  return Gemm::get_workspace_size(arguments(M, N, K, nullptr, nullptr, nullptr, nullptr));
}

// 0 on success; the workspace (workspace_bytes) must stay alive for the launch.
extern "C" int run(int M, int N, int K, const void* A, const void* B, void* D, int* bad, void* workspace,
                   void* stream) {
  Gemm gemm;
  auto args = arguments(M, N, K, A, B, D, bad);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (gemm.initialize(args, workspace, static_cast<cudaStream_t>(stream)) != cutlass::Status::kSuccess) return 2;
  if (gemm.run(static_cast<cudaStream_t>(stream)) != cutlass::Status::kSuccess) return 3;
  return 0;
}
