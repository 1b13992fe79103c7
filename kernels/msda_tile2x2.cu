// tile2x2: one warp per (n, q, head), D = 32. For each batch of up to 8 points of a level, the warp loads the
// 2x2x32 footprint tiles cooperatively into its shared-memory buffer (lane = corner * 8 + 4-channel chunk, so one
// warp-wide load moves one whole tile), then each lane accumulates its channel from the buffer. The same buffer
// is reused for every batch of every level.
#include "msda_common.cuh"

namespace msda {
namespace {

constexpr int kTileD = 32;
constexpr int kTileWarps = 8;
constexpr int kPointBatch = 8;

// 4 channels of one corner: 8 bytes for fp16/bf16, 16 for fp32.
template <typename T> struct Quad { uint2 raw; };
template <> struct Quad<float> { float4 raw; };
template <typename T> __device__ __forceinline__ Quad<T> load4(const T* p) {
  Quad<T> q; q.raw = __ldg(reinterpret_cast<const uint2*>(p)); return q;
}
template <> __device__ __forceinline__ Quad<float> load4<float>(const float* p) {
  Quad<float> q; q.raw = __ldg(reinterpret_cast<const float4*>(p)); return q;
}
template <typename T> __device__ __forceinline__ Quad<T> zero4() { Quad<T> q; q.raw = make_uint2(0, 0); return q; }
template <> __device__ __forceinline__ Quad<float> zero4<float>() {
  Quad<float> q; q.raw = make_float4(0.f, 0.f, 0.f, 0.f); return q;
}

template <typename T>
__global__ void __launch_bounds__(kTileWarps * 32) msda_tile2x2_kernel(
    const T* __restrict__ value, const int64_t* __restrict__ spatial_shapes, const int64_t* __restrict__ level_start,
    const float* __restrict__ loc, const float* __restrict__ attn, T* __restrict__ out, int64_t items, int S, int Lq,
    int M, int L, int P) {
  // [warp][point][corner][channel]; a tile is 4 corners x 32 channels.
  __shared__ __align__(16) T tiles[kTileWarps][kPointBatch][4][kTileD];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int corner = lane >> 3, chunk = lane & 7;  // this lane's share of a tile load
  const int dy = corner >> 1, dx = corner & 1;
  const int64_t item = (int64_t)blockIdx.x * kTileWarps + warp;  // (n * Lq + q) * M + head
  if (item >= items) return;  // whole warp; the kernel has no block-level barrier
  const int head = (int)(item % M);
  const int64_t nq = item / M;
  const int n = (int)(nq / Lq);
  const int64_t sample0 = item * L * P;
  const int pixel_stride = M * kTileD;
  const T* image = value + (int64_t)n * S * pixel_stride + head * kTileD;
  T (*buffer)[4][kTileD] = tiles[warp];
  float acc = 0.f;
  for (int level = 0; level < L; ++level) {
    const int H = (int)__ldg(spatial_shapes + 2 * level), W = (int)__ldg(spatial_shapes + 2 * level + 1);
    const T* level_value = image + __ldg(level_start + level) * pixel_stride;
    for (int first = 0; first < P; first += kPointBatch) {
      const int count = min(kPointBatch, P - first);
      float w[kPointBatch][4];
      // Load phase: every lane computes each point's footprint (same address: broadcast loads) and fetches
      // its corner's 4 channels; 8 loads in flight per lane.
#pragma unroll
      for (int j = 0; j < kPointBatch; ++j) {
        if (j < count) {
          const int64_t sample = sample0 + level * P + first + j;
          const float2 xy = __ldg(reinterpret_cast<const float2*>(loc) + sample);
          const Footprint f = footprint(xy.x, xy.y, H, W, __ldg(attn + sample));
          w[j][0] = f.valid ? f.w00 : 0.f;
          w[j][1] = f.valid ? f.w01 : 0.f;
          w[j][2] = f.valid ? f.w10 : 0.f;
          w[j][3] = f.valid ? f.w11 : 0.f;
          const int y = f.y0 + dy, x = f.x0 + dx;
          Quad<T> q = zero4<T>();
          if (f.valid && inside(y, x, H, W)) q = load4(level_value + ((int64_t)y * W + x) * pixel_stride + chunk * 4);
          *reinterpret_cast<decltype(q.raw)*>(&buffer[j][corner][chunk * 4]) = q.raw;
        }
      }
      __syncwarp();
      // Compute phase: lane = channel.
#pragma unroll
      for (int j = 0; j < kPointBatch; ++j) {
        if (j < count) {
          acc = fmaf(w[j][0], to_float(buffer[j][0][lane]), acc);
          acc = fmaf(w[j][1], to_float(buffer[j][1][lane]), acc);
          acc = fmaf(w[j][2], to_float(buffer[j][2][lane]), acc);
          acc = fmaf(w[j][3], to_float(buffer[j][3][lane]), acc);
        }
      }
      __syncwarp();  // the buffer is overwritten by the next batch
    }
  }
  out[nq * pixel_stride + head * kTileD + lane] = from_float<T>(acc);
}

}  // namespace

const char* launch_tile2x2(const Problem& pb) {
  if (pb.D != kTileD) return plain_message("tile2x2 needs D = 32");
  return dispatch_dtype(pb.dtype, [&](auto tag) -> const char* {
    using T = decltype(tag);
    const int64_t items = pb.N * pb.Lq * pb.M;
    if (items == 0) return nullptr;
    const int64_t blocks = ceil_div(items, kTileWarps);
    if (blocks > INT32_MAX) return plain_message("tile2x2: too many (n, q, head) items");
    msda_tile2x2_kernel<T><<<(unsigned)blocks, kTileWarps * 32, 0, (cudaStream_t)pb.stream>>>(
        static_cast<const T*>(pb.value), pb.spatial_shapes, pb.level_start, pb.loc, pb.attn, static_cast<T*>(pb.out),
        items, (int)pb.S, (int)pb.Lq, (int)pb.M, (int)pb.L, (int)pb.P);
    MSDA_RETURN_IF_ERROR("tile2x2 launch", cudaGetLastError());
    return nullptr;
  });
}

}  // namespace msda
