// tma: each sample's 2x2x32 footprint is one TMA box. Tensor maps per level over value viewed as
// (N, H_l, W_l, M, D), dims innermost-first [D, M, W, H, N], box [D, 1, 2, 2, 1], coordinates
// (0, head, x0, y0, n); TMA's out-of-bounds zero fill is the zero padding (x0 or y0 may be -1).
// One warp per (n, q, head) at a time, persistent over items: lane i issues the box of sample i of a chunk of
// up to 32 (level, point) samples, the chunk completes on the warp's mbarrier, then lane = channel accumulates.
// Two stages per warp: the next chunk's boxes are in flight while the current one is consumed.
#include "msda_common.cuh"

#include "msda_tma_ptx.cuh"

#include <cudaTypedefs.h>
#include <cstring>

namespace msda {
namespace {

constexpr int kTmaD = 32;
constexpr int kTmaMaxLevels = 8;
constexpr int kTmaWarps = 4;

struct TmaLevels {
  CUtensorMap map[kTmaMaxLevels];
  int H[kTmaMaxLevels];
  int W[kTmaMaxLevels];
};

template <typename T>
__global__ void __launch_bounds__(kTmaWarps * 32) msda_tma_kernel(
    const __grid_constant__ TmaLevels levels, const float* __restrict__ loc, const float* __restrict__ attn,
    T* __restrict__ out, int64_t items, int Lq, int M, int L, int P, int slots) {
  constexpr int kBoxBytes = 4 * kTmaD * (int)sizeof(T);
  extern __shared__ __align__(1024) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Per warp: tiles [stage][slot][2][2][D], weights [stage][slot] (float4 = 4 corner weights), 2 mbarriers.
  uint8_t* tiles = smem + (size_t)warp * 2 * slots * kBoxBytes;
  float4* weights = reinterpret_cast<float4*>(smem + (size_t)kTmaWarps * 2 * slots * kBoxBytes) + warp * 2 * slots;
  uint64_t* bars =
      reinterpret_cast<uint64_t*>(smem + (size_t)kTmaWarps * 2 * slots * (kBoxBytes + 16)) + warp * 2;
  if (lane == 0) {
    mbar_init(&bars[0], 1);
    mbar_init(&bars[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();

  const int samples = L * P;
  const int chunks = (samples + slots - 1) / slots;
  const int64_t warp_id = (int64_t)blockIdx.x * kTmaWarps + warp, warp_count = (int64_t)gridDim.x * kTmaWarps;
  const int64_t my_items = warp_id < items ? (items - 1 - warp_id) / warp_count + 1 : 0;
  const int64_t units = my_items * chunks;  // unit = (one of my items, chunk)

  // Issue the boxes of unit u into stage; returns how many boxes (valid samples) it holds, packed in slot order.
  auto issue = [&](int64_t u, int stage) -> int {
    const int64_t item = warp_id + (u / chunks) * warp_count;
    const int head = (int)(item % M);
    const int n = (int)(item / M / Lq);
    const int s = (int)(u % chunks) * slots + lane;
    Footprint f;
    f.valid = false;
    int level = 0;
    if (lane < slots && s < samples) {
      level = s / P;
      const int64_t sample = item * samples + s;
      const float2 xy = __ldg(reinterpret_cast<const float2*>(loc) + sample);
      f = footprint(xy.x, xy.y, levels.H[level], levels.W[level], __ldg(attn + sample));
    }
    const uint32_t mask = __ballot_sync(0xffffffffu, f.valid);
    const int count = __popc(mask);
    if (lane == 0) mbar_arrive_expect_tx(&bars[stage], (uint32_t)count * kBoxBytes);
    if (f.valid) {
      const int slot = __popc(mask & ((1u << lane) - 1u));
      weights[stage * slots + slot] = make_float4(f.w00, f.w01, f.w10, f.w11);
      tma_box_5d(tiles + (size_t)(stage * slots + slot) * kBoxBytes, &levels.map[level], 0, head, f.x0, f.y0, n,
                 &bars[stage]);
    }
    __syncwarp();  // the weights are read by every lane after the wait
    return count;
  };

  int count0 = 0, count1 = 0;
  uint32_t parity = 0;  // bit s: phase parity of stage s
  float acc = 0.f;
  if (units > 0) count0 = issue(0, 0);
  for (int64_t u = 0; u < units; ++u) {
    const int stage = (int)(u & 1);
    if (u + 1 < units) {
      const int next = issue(u + 1, stage ^ 1);
      if (stage == 0) count1 = next; else count0 = next;
    }
    mbar_wait(&bars[stage], (parity >> stage) & 1u);
    parity ^= 1u << stage;
    const int count = stage == 0 ? count0 : count1;
    const T* tile = reinterpret_cast<const T*>(tiles + (size_t)stage * slots * kBoxBytes);
    const float4* w = weights + stage * slots;
    for (int i = 0; i < count; ++i, tile += 4 * kTmaD) {
      const float4 wi = w[i];  // same address for all lanes: broadcast
      acc = fmaf(wi.x, to_float(tile[lane]), acc);
      acc = fmaf(wi.y, to_float(tile[kTmaD + lane]), acc);
      acc = fmaf(wi.z, to_float(tile[2 * kTmaD + lane]), acc);
      acc = fmaf(wi.w, to_float(tile[3 * kTmaD + lane]), acc);
    }
    if (u % chunks == chunks - 1) {
      const int64_t item = warp_id + (u / chunks) * warp_count;
      out[item * kTmaD + lane] = from_float<T>(acc);  // item = (n*Lq + q)*M + head: out row-major (N, Lq, M*D)
      acc = 0.f;
    }
    __syncwarp();  // this stage's tiles and weights are overwritten by the issue two units later
  }
}

PFN_cuTensorMapEncodeTiled_v12000 get_encode() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (!encode) {
    cudaDriverEntryPointQueryResult query;
    void* fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &query) ==
            cudaSuccess &&
        query == cudaDriverEntryPointSuccess)
      encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  return encode;
}

}  // namespace

// Shared with microbench.cu: a tensor map over (N, H, W, M, D) with box [D, 1, 2, 2, 1] and zero OOB fill.
const char* encode_box_map(CUtensorMap* map, const void* base, int dtype, int64_t N, int64_t H, int64_t W, int64_t M,
                           int64_t D, int64_t image_stride_elems) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = get_encode();
  if (!encode) return plain_message("cuTensorMapEncodeTiled not found through cudaGetDriverEntryPointByVersion");
  const CUtensorMapDataType type = dtype == kF32   ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : dtype == kF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                   : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const int64_t elem = dtype == kF32 ? 4 : 2;
  cuuint64_t dims[5] = {(cuuint64_t)D, (cuuint64_t)M, (cuuint64_t)W, (cuuint64_t)H, (cuuint64_t)N};
  cuuint64_t strides[4] = {(cuuint64_t)(D * elem), (cuuint64_t)(M * D * elem), (cuuint64_t)(W * M * D * elem),
                           (cuuint64_t)(image_stride_elems * elem)};
  cuuint32_t box[5] = {(cuuint32_t)D, 1, 2, 2, 1};
  cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  auto run = [&] {
    return encode(map, type, 5, const_cast<void*>(base), dims, strides, box, element_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  };
  CUresult r = run();
  if (r == CUDA_ERROR_INVALID_CONTEXT) {
    // A thread that has made no runtime call yet has no current context (the driver call needs one):
    // cudaFree(nullptr) binds the device's primary context to this thread.
    cudaFree(nullptr);
    r = run();
  }
  if (r != CUDA_SUCCESS)
    return plain_message("cuTensorMapEncodeTiled failed with CUresult " + std::to_string((int)r) + " (N=" +
                         std::to_string(N) + " H=" + std::to_string(H) + " W=" + std::to_string(W) + ")");
  return nullptr;
}

const char* launch_tma(const Problem& pb) {
  if (pb.D != kTmaD) return plain_message("tma needs D = 32");
  if (pb.L < 1 || pb.L > kTmaMaxLevels) return plain_message("tma needs 1 <= L <= 8");
  if (!pb.host_shapes || !pb.host_starts) return plain_message("tma needs host copies of the level shapes");
  return dispatch_dtype(pb.dtype, [&](auto tag) -> const char* {
    using T = decltype(tag);
    const int64_t items = pb.N * pb.Lq * pb.M;
    if (items == 0) return nullptr;
    TmaLevels levels;
    memset(&levels, 0, sizeof(levels));
    for (int l = 0; l < pb.L; ++l) {
      const int64_t H = pb.host_shapes[2 * l], W = pb.host_shapes[2 * l + 1];
      levels.H[l] = (int)H;
      levels.W[l] = (int)W;
      const T* base = static_cast<const T*>(pb.value) + pb.host_starts[l] * pb.M * pb.D;
      if (const char* e = encode_box_map(&levels.map[l], base, pb.dtype, pb.N, H, W, pb.M, pb.D, pb.S * pb.M * pb.D))
        return e;
    }
    const int slots = (int)std::min<int64_t>(32, pb.L * pb.P);
    const int box_bytes = 4 * kTmaD * (int)sizeof(T);
    const size_t smem = (size_t)kTmaWarps * 2 * slots * (box_bytes + 16) + kTmaWarps * 2 * sizeof(uint64_t);
    // Attribute and occupancy depend on (T, smem) only: query once per size.
    static thread_local int64_t cached_smem = -1;
    static thread_local int cached_blocks = 0;
    if (cached_smem != (int64_t)smem) {
      MSDA_RETURN_IF_ERROR("tma smem attribute", cudaFuncSetAttribute(msda_tma_kernel<T>,
                                                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      int device = 0, sms = 0, per_sm = 0;
      MSDA_RETURN_IF_ERROR("tma device", cudaGetDevice(&device));
      MSDA_RETURN_IF_ERROR("tma sm count", cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      MSDA_RETURN_IF_ERROR("tma occupancy", cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                                &per_sm, msda_tma_kernel<T>, kTmaWarps * 32, smem));
      if (per_sm < 1) return plain_message("tma: the kernel does not fit on an SM");
      cached_smem = (int64_t)smem;
      cached_blocks = sms * per_sm;
    }
    const int64_t blocks = std::min<int64_t>(cached_blocks, ceil_div(items, kTmaWarps));
    msda_tma_kernel<T><<<(unsigned)blocks, kTmaWarps * 32, smem, (cudaStream_t)pb.stream>>>(
        levels, pb.loc, pb.attn, static_cast<T*>(pb.out), items, (int)pb.Lq, (int)pb.M, (int)pb.L, (int)pb.P, slots);
    MSDA_RETURN_IF_ERROR("tma launch", cudaGetLastError());
    return nullptr;
  });
}

}  // namespace msda
