// Host interface of the CUDA C++ baselines: plain C++ types only, so that the torch binding (bindings.cpp)
// compiles without CUDA headers and the kernels (*.cu) compile without torch headers.
#pragma once
#include <cstdint>

namespace msda {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// One MSDA forward problem. value (N, S, M, D); spatial_shapes (L, 2) (H, W); level_start (L,);
// loc (N, Lq, M, L, P, 2) fp32 as (x, y) in [0, 1]; attn (N, Lq, M, L, P) fp32; out (N, Lq, M*D) in value's dtype.
struct Problem {
  const void* value = nullptr;
  const int64_t* spatial_shapes = nullptr;  // device copy: read in-kernel by classic, vec, tile2x2
  const int64_t* level_start = nullptr;     // device copy
  const int64_t* host_shapes = nullptr;     // host copy (L*2): tma and distributed size their launch from it
  const int64_t* host_starts = nullptr;     // host copy (L)
  const float* loc = nullptr;
  const float* attn = nullptr;
  void* out = nullptr;
  int64_t N = 0, S = 0, Lq = 0, M = 0, D = 0, L = 0, P = 0;
  int dtype = kF32;
  void* stream = nullptr;  // cudaStream_t
};

// Each launcher returns nullptr on success, else a message (valid until the next call on this thread).
const char* launch_classic(const Problem& pb);
const char* launch_vec(const Problem& pb);
const char* launch_tile2x2(const Problem& pb);
const char* launch_tma(const Problem& pb);
// cluster_size 0 picks the smallest of 8, 16 whose per-CTA share of the largest level fits in shared memory.
const char* launch_distributed(const Problem& pb, int cluster_size);

struct ClusterInfo {
  int cluster_size = 0;
  int64_t smem_bytes = 0;         // dynamic shared memory per CTA
  int64_t grid_clusters = 0;      // clusters in the launch
  int64_t max_active_clusters = 0;  // cudaOccupancyMaxActiveClusters: how many can be resident at once
  int threads_per_cta = 0;
};
const char* distributed_info(const Problem& pb, int cluster_size, ClusterInfo* info);

// ---- microbenchmarks (microbench.cu) ----
// Copies one TMA box [D,1,2,2,1] per row of coords (int32 (K,4) = n, m, x0, y0, any of them out of range)
// from value (N, H, W, M, D) into out (K, 2, 2, D), same dtype as value.
const char* tma_box_check(const void* value, int dtype, int64_t N, int64_t H, int64_t W, int64_t M, int64_t D,
                          const int32_t* coords, int64_t K, void* out, void* stream);

enum TileMethod : int { kTileLdg = 0, kTileMemcpyAsync = 1, kTileTma = 2 };
// Brings K 2x2x32 fp16 tiles (coords int32 (K,4) = n, y0, x0, m with y0 in [-1, H-1], x0 in [-1, W-1];
// out-of-range corners are zero) into shared memory, batch tiles per warp per round, from value (N, H, W, M, 32).
// write_out: copy each tile to out (K, 2, 2, 32) fp16 (for the exact check); else XOR the tile's words into
// checksum (blocks * threads uint32) so that the loads cannot be dropped.
const char* tile_copy(int method, int batch, const void* value, int64_t N, int64_t H, int64_t W, int64_t M,
                      const int32_t* coords, int64_t K, void* out, uint32_t* checksum, int blocks, bool write_out,
                      void* stream);
// Blocks per SM that the tile copy kernel of this method and batch can keep resident.
const char* tile_copy_occupancy(int method, int batch, int* blocks_per_sm, int* threads_per_block);

}  // namespace msda
