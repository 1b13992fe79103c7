// distributed: a thread-block cluster of C CTAs shares one (image, head). For each level in turn, CTA r of the
// cluster stages rows [r*R, (r+1)*R) of that level's feature map (R = ceil(H/C)) into its shared memory, so
// the cluster holds the whole level in distributed shared memory; after a cluster barrier every thread gathers
// its corners from the owning CTA through cluster.map_shared_rank. The staging buffer is reused across levels.
// Thread = (query, 8 channels), D = 32; 64 or 128 queries per CTA (256 or 512 threads).
//
// Why this cannot hang with many clusters: a CTA waits only at cluster barriers of its own cluster, whose CTAs
// the hardware schedules together (cluster launch guarantee); there is no dependency between clusters, so any
// number of clusters runs in waves. Every CTA of a cluster executes the same number of cluster barriers (the
// loop bounds depend on the level count only, never on the CTA's own query range), and the barrier after the
// last level keeps each CTA's shared memory alive until its peers have finished reading it.
#include "msda_common.cuh"

#include <cooperative_groups.h>

namespace msda {
namespace {

namespace cg = cooperative_groups;

constexpr int kDistD = 32;
constexpr int kDistGroups = kDistD / 8;  // threads per query
constexpr int kDistMaxLevels = 8;
// 512 threads per CTA when the level share takes most of an SM's shared memory (one CTA per SM), else 256 so that
// several CTAs (and clusters) fit on an SM.
constexpr size_t kDistBigSmem = 100 * 1024;

struct DistLevels {
  int64_t start[kDistMaxLevels];
  int H[kDistMaxLevels];
  int W[kDistMaxLevels];
  int rows[kDistMaxLevels];  // R: rows per CTA
};

__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}

template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS, THREADS == 256 ? 2 : 1) msda_distributed_kernel(
    const __grid_constant__ DistLevels levels, const T* __restrict__ value, const float* __restrict__ loc,
    const float* __restrict__ attn, T* __restrict__ out, int S, int Lq, int M, int L, int P) {
  constexpr int kQueries = THREADS / kDistGroups;  // queries per CTA
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  T* rows_here = reinterpret_cast<T*>(smem_raw);  // [row][x][D] of this CTA's share of the current level
  const int C = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();
  const int head = blockIdx.y, n = blockIdx.z;
  const int query_chunk = blockIdx.x / C;
  const int q = (query_chunk * C + rank) * kQueries + threadIdx.x / kDistGroups;
  const int group = threadIdx.x % kDistGroups;
  const bool active = q < Lq;
  const int pixel_stride = M * kDistD;
  const T* image = value + (int64_t)n * S * pixel_stride + head * kDistD;
  const int64_t sample0 = (((int64_t)n * Lq + (active ? q : 0)) * M + head) * L * P;
  constexpr int kPiecesPerPixel = kDistD * (int)sizeof(T) / 16;  // 16-byte pieces
  constexpr int kElemsPerPiece = 16 / (int)sizeof(T);

  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;

  for (int level = 0; level < L; ++level) {
    const int H = levels.H[level], W = levels.W[level], R = levels.rows[level];
    // Stage this CTA's rows of the level.
    const int row0 = rank * R;
    const int my_rows = max(0, min(H, row0 + R) - row0);
    const T* src = image + (levels.start[level] + (int64_t)row0 * W) * pixel_stride;
    const int pieces = my_rows * W * kPiecesPerPixel;
    for (int i = threadIdx.x; i < pieces; i += THREADS) {
      const int pixel = i / kPiecesPerPixel, piece = i % kPiecesPerPixel;
      cp_async_16(rows_here + pixel * kDistD + piece * kElemsPerPiece,
                  src + (int64_t)pixel * pixel_stride + piece * kElemsPerPiece);
    }
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
    // The cluster barrier orders everything; the CTA barrier beside it changes nothing but lets compute-sanitizer's
    // racecheck see the ordering of this CTA's cp.async writes and its own threads' reads.
    __syncthreads();
    cluster.sync();  // the whole level is now in the cluster's shared memory

    if (active) {
      const float2* level_loc = reinterpret_cast<const float2*>(loc) + sample0 + level * P;
      const float* level_attn = attn + sample0 + level * P;
      // Points in groups, all corner loads of a group issued before any FMA: the gathers are latency-bound
      // (remote shared memory), so several must be in flight per thread.
      constexpr int kGroup = sizeof(T) == 4 ? 2 : 4;
      for (int first = 0; first < P; first += kGroup) {
        Chunk8<T> c[kGroup][4];
        float w[kGroup][4];
#pragma unroll
        for (int j = 0; j < kGroup; ++j) {
#pragma unroll
          for (int k = 0; k < 4; ++k) { c[j][k] = zero8<T>(); w[j][k] = 0.f; }
          if (first + j < P) {
            const float2 xy = __ldg(level_loc + first + j);
            const Footprint f = footprint(xy.x, xy.y, H, W, __ldg(level_attn + first + j));
            if (f.valid) {
              w[j][0] = f.w00; w[j][1] = f.w01; w[j][2] = f.w10; w[j][3] = f.w11;
#pragma unroll
              for (int k = 0; k < 4; ++k) {
                const int y = f.y0 + (k >> 1), x = f.x0 + (k & 1);
                if (inside(y, x, H, W)) {
                  const int owner = y / R;
                  const T* remote = cluster.map_shared_rank(rows_here, owner);
                  c[j][k] = load8_generic(remote + ((y - owner * R) * W + x) * kDistD + group * 8);
                }
              }
            }
          }
        }
#pragma unroll
        for (int j = 0; j < kGroup; ++j)
#pragma unroll
          for (int k = 0; k < 4; ++k) fma8(acc, w[j][k], c[j][k]);
      }
    }
    __syncthreads();
    cluster.sync();  // no CTA restages, or exits, while a peer may still read its rows
  }
  if (active) store8(out + (((int64_t)n * Lq + q) * M + head) * kDistD + group * 8, acc);
}

struct DistPlan {
  DistLevels levels;
  int cluster_size = 0;
  int threads = 0;
  size_t smem = 0;
  dim3 grid;
};

template <typename T, int THREADS>
const char* set_attributes(const DistPlan& plan) {
  MSDA_RETURN_IF_ERROR("distributed smem attribute",
                       cudaFuncSetAttribute(msda_distributed_kernel<T, THREADS>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, (int)plan.smem));
  if (plan.cluster_size > 8)
    MSDA_RETURN_IF_ERROR("distributed non-portable cluster",
                         cudaFuncSetAttribute(msda_distributed_kernel<T, THREADS>,
                                              cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  return nullptr;
}

template <typename T>
const char* plan_distributed(const Problem& pb, int cluster_size, DistPlan* plan) {
  if (pb.D != kDistD) return plain_message("distributed needs D = 32");
  if (pb.L < 1 || pb.L > kDistMaxLevels) return plain_message("distributed needs 1 <= L <= 8");
  if (!pb.host_shapes || !pb.host_starts) return plain_message("distributed needs host copies of the level shapes");
  if (pb.M > 65535 || pb.N > 65535) return plain_message("distributed: M and N must be at most 65535");
  int device = 0, smem_limit = 0;
  MSDA_RETURN_IF_ERROR("distributed device", cudaGetDevice(&device));
  MSDA_RETURN_IF_ERROR("distributed smem limit",
                       cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  auto smem_for = [&](int c) {
    size_t most = 0;
    for (int l = 0; l < pb.L; ++l) {
      const int64_t H = pb.host_shapes[2 * l], W = pb.host_shapes[2 * l + 1];
      most = std::max(most, (size_t)(ceil_div(H, c) * W * kDistD * sizeof(T)));
    }
    return most;
  };
  int c = cluster_size;
  if (c == 0) {
    for (int candidate : {8, 16})
      if (smem_for(candidate) <= (size_t)smem_limit) { c = candidate; break; }
    if (c == 0) return plain_message("distributed: the largest level does not fit in a cluster of 16 CTAs");
  }
  if (c != 1 && c != 2 && c != 4 && c != 8 && c != 16) return plain_message("distributed: cluster size 1, 2, 4, 8 or 16");
  if (smem_for(c) > (size_t)smem_limit)
    return plain_message("distributed: a CTA's share of the largest level (" + std::to_string(smem_for(c)) +
                         " B) exceeds shared memory (" + std::to_string(smem_limit) + " B) at cluster size " +
                         std::to_string(c));
  for (int l = 0; l < pb.L; ++l) {
    plan->levels.start[l] = pb.host_starts[l];
    plan->levels.H[l] = (int)pb.host_shapes[2 * l];
    plan->levels.W[l] = (int)pb.host_shapes[2 * l + 1];
    plan->levels.rows[l] = (int)ceil_div(pb.host_shapes[2 * l], c);
  }
  plan->cluster_size = c;
  plan->smem = std::max<size_t>(smem_for(c), 16);
  plan->threads = plan->smem > kDistBigSmem ? 512 : 256;
  const int64_t queries_per_cta = plan->threads / kDistGroups;
  const int64_t chunks = ceil_div(pb.Lq, (int64_t)c * queries_per_cta);
  if (chunks * c > INT32_MAX) return plain_message("distributed: too many queries");
  plan->grid = dim3((unsigned)(chunks * c), (unsigned)pb.M, (unsigned)pb.N);
  return plan->threads == 512 ? set_attributes<T, 512>(*plan) : set_attributes<T, 256>(*plan);
}

struct LaunchConfig {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attribute[1];
  LaunchConfig(const DistPlan& plan, cudaStream_t stream) {
    config.gridDim = plan.grid;
    config.blockDim = dim3(plan.threads, 1, 1);
    config.dynamicSmemBytes = plan.smem;
    config.stream = stream;
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = plan.cluster_size;
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
};

template <typename T, int THREADS>
const char* launch_planned(const Problem& pb, const DistPlan& plan) {
  LaunchConfig launch(plan, (cudaStream_t)pb.stream);
  MSDA_RETURN_IF_ERROR("distributed launch",
                       cudaLaunchKernelEx(&launch.config, msda_distributed_kernel<T, THREADS>, plan.levels,
                                          static_cast<const T*>(pb.value), pb.loc, pb.attn, static_cast<T*>(pb.out),
                                          (int)pb.S, (int)pb.Lq, (int)pb.M, (int)pb.L, (int)pb.P));
  MSDA_RETURN_IF_ERROR("distributed launch", cudaGetLastError());
  return nullptr;
}

template <typename T, int THREADS>
const char* max_active_clusters(const Problem& pb, const DistPlan& plan, int* active) {
  LaunchConfig launch(plan, (cudaStream_t)pb.stream);
  MSDA_RETURN_IF_ERROR("distributed max active clusters",
                       cudaOccupancyMaxActiveClusters(active, msda_distributed_kernel<T, THREADS>, &launch.config));
  return nullptr;
}

}  // namespace

const char* launch_distributed(const Problem& pb, int cluster_size) {
  return dispatch_dtype(pb.dtype, [&](auto tag) -> const char* {
    using T = decltype(tag);
    if (pb.N * pb.Lq * pb.M == 0) return nullptr;
    DistPlan plan;
    if (const char* e = plan_distributed<T>(pb, cluster_size, &plan)) return e;
    return plan.threads == 512 ? launch_planned<T, 512>(pb, plan) : launch_planned<T, 256>(pb, plan);
  });
}

const char* distributed_info(const Problem& pb, int cluster_size, ClusterInfo* info) {
  return dispatch_dtype(pb.dtype, [&](auto tag) -> const char* {
    using T = decltype(tag);
    DistPlan plan;
    if (const char* e = plan_distributed<T>(pb, cluster_size, &plan)) return e;
    int active = 0;
    const char* e = plan.threads == 512 ? max_active_clusters<T, 512>(pb, plan, &active)
                                        : max_active_clusters<T, 256>(pb, plan, &active);
    if (e) return e;
    info->cluster_size = plan.cluster_size;
    info->smem_bytes = (int64_t)plan.smem;
    info->grid_clusters = (int64_t)plan.grid.x / plan.cluster_size * plan.grid.y * plan.grid.z;
    info->max_active_clusters = active;
    info->threads_per_cta = plan.threads;
    return nullptr;
  });
}

}  // namespace msda
