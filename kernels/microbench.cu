// Microbenchmarks behind the TMA design question.
// 1. tma_box_check: one [D,1,2,2,1] TMA box per coordinate row, copied out verbatim, so that the caller can compare
//    exactly with a zero-padded gather: out-of-bounds fill and negative coordinates.
// 2. tile_copy: 2x2x32 fp16 tiles (256 B) brought into shared memory three ways, batch tiles per warp per round:
//    cooperative 16-byte LDG (16 lanes per tile), cooperative_groups::memcpy_async (4-lane groups, one 64-byte corner
//    each) and one TMA box per tile (one lane per box, completing on the warp's mbarrier). Every method then reads
//    the batch back from shared memory the same way.
#include "msda_tma_ptx.cuh"

#include <cooperative_groups.h>
#include <cooperative_groups/memcpy_async.h>
#include <cuda/barrier>

namespace msda {
namespace {

namespace cg = cooperative_groups;

template <typename T>
__global__ void __launch_bounds__(128) tma_box_check_kernel(const __grid_constant__ CUtensorMap map,
                                                            const int4* __restrict__ coords, int64_t K, int D,
                                                            uint4* __restrict__ out) {
  extern __shared__ __align__(128) uint8_t box[];  // the box, then its mbarrier (box bytes are a multiple of 16)
  const int box_bytes = 4 * D * (int)sizeof(T);
  uint64_t& bar = *reinterpret_cast<uint64_t*>(box + box_bytes);
  if (threadIdx.x == 0) {
    mbar_init(&bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  uint32_t parity = 0;
  for (int64_t k = blockIdx.x; k < K; k += gridDim.x) {
    if (threadIdx.x == 0) {
      const int4 c = coords[k];  // n, head, x0, y0
      mbar_arrive_expect_tx(&bar, (uint32_t)box_bytes);
      tma_box_5d(box, &map, 0, c.y, c.z, c.w, c.x, &bar);
    }
    mbar_wait(&bar, parity);
    parity ^= 1;
    const uint4* s4 = reinterpret_cast<const uint4*>(box);
    for (int i = threadIdx.x; i < box_bytes / 16; i += blockDim.x) out[k * (box_bytes / 16) + i] = s4[i];
    __syncthreads();  // the box is overwritten next round
  }
}

constexpr int kCopyWarps = 8;
constexpr int kTileBytes = 256;  // 2 x 2 x 32 fp16

template <int METHOD, int BATCH>
__global__ void __launch_bounds__(kCopyWarps * 32, 1) tile_copy_kernel(
    const __grid_constant__ CUtensorMap map, const uint4* __restrict__ value, const int4* __restrict__ coords,
    int64_t K, int H, int W, int M, uint4* __restrict__ out, uint32_t* __restrict__ checksum, bool write_out) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint8_t* buffer = smem + warp * BATCH * kTileBytes;  // [tile][dy][dx][32 channels], the TMA box layout
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + kCopyWarps * BATCH * kTileBytes) + warp;
  if (METHOD == kTileTma) {
    if (lane == 0) {
      mbar_init(bar, 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
  }
  const int64_t rounds = K / BATCH;
  uint32_t parity = 0, acc = 0;
  cg::thread_block_tile<32> warp_group = cg::tiled_partition<32>(cg::this_thread_block());
  for (int64_t r = (int64_t)blockIdx.x * kCopyWarps + warp; r < rounds; r += (int64_t)gridDim.x * kCopyWarps) {
    const int64_t base = r * BATCH;
    if (METHOD == kTileLdg) {
      // 16 lanes per tile: lane bits [corner:2][piece:2], 2 tiles per warp-wide load, BATCH/2 loads in flight.
      const int corner = (lane >> 2) & 3, piece = lane & 3;
      uint4 v[BATCH / 2];
#pragma unroll
      for (int s = 0; s < BATCH / 2; ++s) {
        const int tile = 2 * s + (lane >> 4);
        const int4 c = __ldg(coords + base + tile);  // n, y0, x0, head
        const int y = c.y + (corner >> 1), x = c.z + (corner & 1);
        v[s] = inside(y, x, H, W) ? __ldg(value + ((((int64_t)c.x * H + y) * W + x) * M + c.w) * 4 + piece)
                                  : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int s = 0; s < BATCH / 2; ++s)
        reinterpret_cast<uint4*>(buffer)[(2 * s + (lane >> 4)) * 16 + corner * 4 + piece] = v[s];
      __syncwarp();
    } else if (METHOD == kTileMemcpyAsync) {
      // 8 groups of 4 lanes; a group copies one 64-byte corner per call.
      cg::thread_block_tile<4> quad = cg::tiled_partition<4>(warp_group);
      const int g = lane >> 2;
      for (int j = g; j < BATCH * 4; j += 8) {
        const int tile = j >> 2, corner = j & 3;
        const int4 c = __ldg(coords + base + tile);
        const int y = c.y + (corner >> 1), x = c.z + (corner & 1);
        uint8_t* dst = buffer + tile * kTileBytes + corner * 64;
        if (inside(y, x, H, W)) {
          const uint4* src = value + ((((int64_t)c.x * H + y) * W + x) * M + c.w) * 4;
          cg::memcpy_async(quad, reinterpret_cast<uint4*>(dst), src, cuda::aligned_size_t<16>(64));
        } else {
          reinterpret_cast<uint4*>(dst)[quad.thread_rank()] = make_uint4(0, 0, 0, 0);
        }
      }
      cg::wait(warp_group);
    } else {
      if (lane == 0) mbar_arrive_expect_tx(bar, BATCH * kTileBytes);
      __syncwarp();
      for (int t = lane; t < BATCH; t += 32) {
        const int4 c = __ldg(coords + base + t);
        tma_box_5d(buffer + t * kTileBytes, &map, 0, c.w, c.z, c.y, c.x, bar);
      }
      mbar_wait(bar, parity);
      parity ^= 1;
    }
    const uint4* s4 = reinterpret_cast<const uint4*>(buffer);
    if (write_out) {
      for (int i = lane; i < BATCH * 16; i += 32) out[base * 16 + i] = s4[i];
    } else {
#pragma unroll 4
      for (int i = lane; i < BATCH * 16; i += 32) {
        const uint4 v = s4[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
      }
    }
    __syncwarp();  // the buffer is refilled next round
  }
  checksum[(int64_t)blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

template <int METHOD, int BATCH>
size_t tile_copy_smem() {
  return (size_t)kCopyWarps * BATCH * kTileBytes + kCopyWarps * sizeof(uint64_t);
}

template <typename Fn> const char* dispatch_tile(int method, int batch, Fn&& fn) {
#define MSDA_TILE_CASE(M_, B_) \
  if (method == M_ && batch == B_) return fn(tile_copy_kernel<M_, B_>, tile_copy_smem<M_, B_>());
  MSDA_TILE_CASE(kTileLdg, 8) MSDA_TILE_CASE(kTileLdg, 32)
  MSDA_TILE_CASE(kTileMemcpyAsync, 8) MSDA_TILE_CASE(kTileMemcpyAsync, 32)
  MSDA_TILE_CASE(kTileTma, 8) MSDA_TILE_CASE(kTileTma, 32)
#undef MSDA_TILE_CASE
  return plain_message("tile_copy: method 0..2 and batch 8 or 32");
}

}  // namespace

const char* tma_box_check(const void* value, int dtype, int64_t N, int64_t H, int64_t W, int64_t M, int64_t D,
                          const int32_t* coords, int64_t K, void* out, void* stream) {
  return dispatch_dtype(dtype, [&](auto tag) -> const char* {
    using T = decltype(tag);
    if (K == 0) return nullptr;
    if ((D * (int64_t)sizeof(T)) % 16 != 0) return plain_message("tma_box_check: D * element size must be a multiple of 16");
    CUtensorMap map;
    if (const char* e = encode_box_map(&map, value, dtype, N, H, W, M, D, H * W * M * D)) return e;
    const size_t smem = (size_t)4 * D * sizeof(T) + sizeof(uint64_t);
    MSDA_RETURN_IF_ERROR("tma_box_check smem attribute",
                         cudaFuncSetAttribute(tma_box_check_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              (int)smem));
    const int64_t blocks = std::min<int64_t>(K, 1024);
    tma_box_check_kernel<T><<<(unsigned)blocks, 128, smem, (cudaStream_t)stream>>>(
        map, reinterpret_cast<const int4*>(coords), K, (int)D, static_cast<uint4*>(out));
    MSDA_RETURN_IF_ERROR("tma_box_check launch", cudaGetLastError());
    return nullptr;
  });
}

const char* tile_copy(int method, int batch, const void* value, int64_t N, int64_t H, int64_t W, int64_t M,
                      const int32_t* coords, int64_t K, void* out, uint32_t* checksum, int blocks, bool write_out,
                      void* stream) {
  if (K % batch != 0) return plain_message("tile_copy: K must be a multiple of the batch");
  CUtensorMap map;
  memset(&map, 0, sizeof(map));
  if (method == kTileTma)
    if (const char* e = encode_box_map(&map, value, kF16, N, H, W, M, 32, H * W * M * 32)) return e;
  return dispatch_tile(method, batch, [&](auto kernel, size_t smem) -> const char* {
    MSDA_RETURN_IF_ERROR("tile_copy smem attribute",
                         cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<blocks, kCopyWarps * 32, smem, (cudaStream_t)stream>>>(
        map, static_cast<const uint4*>(value), reinterpret_cast<const int4*>(coords), K, (int)H, (int)W, (int)M,
        static_cast<uint4*>(out), checksum, write_out);
    MSDA_RETURN_IF_ERROR("tile_copy launch", cudaGetLastError());
    return nullptr;
  });
}

const char* tile_copy_occupancy(int method, int batch, int* blocks_per_sm, int* threads_per_block) {
  return dispatch_tile(method, batch, [&](auto kernel, size_t smem) -> const char* {
    MSDA_RETURN_IF_ERROR("tile_copy smem attribute",
                         cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    MSDA_RETURN_IF_ERROR("tile_copy occupancy",
                         cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, kernel, kCopyWarps * 32, smem));
    *threads_per_block = kCopyWarps * 32;
    return nullptr;
  });
}

}  // namespace msda
