// tile2x2: one warp per (n, q, head), D = 32. The warp takes up to 32 (level, point) samples at a time: each lane
// computes one sample's footprint into shared memory; then, for each batch of 16 samples (8 for fp32), the warp
// loads the 2x2x32 footprint tiles cooperatively into its shared-memory buffer (lane = corner * 8 + 4-channel
// chunk, so one warp-wide load moves one whole tile), and each lane accumulates its channel from the buffer. The
// same buffer is reused for every batch of every level.
#include "msda_common.cuh"

namespace msda {
namespace {

constexpr int kTileD = 32;
constexpr int kTileWarps = 8;
constexpr int kSamplesPerRound = 32;  // one footprint per lane

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

// Tiles per batch: 16 for 2-byte types (32 KB of tiles per CTA), 8 for fp32 (same bytes).
template <typename T> constexpr int tile_batch() { return sizeof(T) == 4 ? 8 : 16; }

template <typename T>
__global__ void __launch_bounds__(kTileWarps * 32) msda_tile2x2_kernel(
    const T* __restrict__ value, const int64_t* __restrict__ spatial_shapes, const int64_t* __restrict__ level_start,
    const float* __restrict__ loc, const float* __restrict__ attn, T* __restrict__ out, int64_t items, int S, int Lq,
    int M, int L, int P) {
  constexpr int kBatch = tile_batch<T>();
  // Per warp: the tile buffer [tile][corner][channel] (reused by every batch of every level), and one footprint
  // per sample of the current round: corner weights, and (pixel of corner (0,0) in the image, W | corner mask << 24).
  __shared__ __align__(16) T tiles[kTileWarps][kBatch][4][kTileD];
  __shared__ float4 weights[kTileWarps][kSamplesPerRound];
  __shared__ int2 where[kTileWarps][kSamplesPerRound];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int corner = lane >> 3, chunk = lane & 7;  // this lane's share of a tile load
  const int dy = corner >> 1, dx = corner & 1;
  const int64_t item = (int64_t)blockIdx.x * kTileWarps + warp;  // (n * Lq + q) * M + head
  if (item >= items) return;  // whole warp; the kernel has no block-level barrier
  const int head = (int)(item % M);
  const int64_t nq = item / M;
  const int n = (int)(nq / Lq);
  const int samples = L * P;
  const int64_t sample0 = item * samples;
  const int pixel_stride = M * kTileD;
  const T* image = value + (int64_t)n * S * pixel_stride + head * kTileD;
  T (*buffer)[4][kTileD] = tiles[warp];
  float acc = 0.f;
  for (int first = 0; first < samples; first += kSamplesPerRound) {
    const int count = min(kSamplesPerRound, samples - first);
    // Footprint phase: lane = sample (levels differ across lanes).
    if (lane < count) {
      const int s = first + lane, level = s / P;
      const int H = (int)__ldg(spatial_shapes + 2 * level), W = (int)__ldg(spatial_shapes + 2 * level + 1);
      const float2 xy = __ldg(reinterpret_cast<const float2*>(loc) + sample0 + s);
      const Footprint f = footprint(xy.x, xy.y, H, W, __ldg(attn + sample0 + s));
      const bool top = f.y0 >= 0, bottom = f.y0 + 1 < H, left = f.x0 >= 0, right = f.x0 + 1 < W;
      const unsigned mask = f.valid ? ((top && left) | (top && right) << 1 | (bottom && left) << 2 |
                                       (bottom && right) << 3)
                                    : 0u;
      // a skipped sample adds 0 even when its location is NaN
      weights[warp][lane] = f.valid ? make_float4(f.w00, f.w01, f.w10, f.w11) : make_float4(0.f, 0.f, 0.f, 0.f);
      where[warp][lane] = make_int2((int)__ldg(level_start + level) + f.y0 * W + f.x0, W | (int)(mask << 24));
    }
    __syncwarp();
    for (int b = 0; b < count; b += kBatch) {
      const int nb = min(kBatch, count - b);
      // Load phase: one warp-wide load moves one whole tile (lane = corner x 4-channel chunk).
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (j < nb) {
          const int2 wh = where[warp][b + j];  // same address for all lanes: broadcast
          const int W = wh.y & 0xffffff;
          Quad<T> q = zero4<T>();
          if ((wh.y >> (24 + corner)) & 1)
            q = load4(image + (int64_t)(wh.x + dy * W + dx) * pixel_stride + chunk * 4);
          *reinterpret_cast<decltype(q.raw)*>(&buffer[j][corner][chunk * 4]) = q.raw;
        }
      }
      __syncwarp();
      // Compute phase: lane = channel.
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (j < nb) {
          const float4 w = weights[warp][b + j];
          acc = fmaf(w.x, to_float(buffer[j][0][lane]), acc);
          acc = fmaf(w.y, to_float(buffer[j][1][lane]), acc);
          acc = fmaf(w.z, to_float(buffer[j][2][lane]), acc);
          acc = fmaf(w.w, to_float(buffer[j][3][lane]), acc);
        }
      }
      __syncwarp();  // the buffer (and, after the last batch, the footprints) are overwritten next
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
    if (pb.S >= (int64_t)1 << 31) return plain_message("tile2x2: S must fit in int32");
    msda_tile2x2_kernel<T><<<(unsigned)blocks, kTileWarps * 32, 0, (cudaStream_t)pb.stream>>>(
        static_cast<const T*>(pb.value), pb.spatial_shapes, pb.level_start, pb.loc, pb.attn, static_cast<T*>(pb.out),
        items, (int)pb.S, (int)pb.Lq, (int)pb.M, (int)pb.L, (int)pb.P);
    MSDA_RETURN_IF_ERROR("tile2x2 launch", cudaGetLastError());
    return nullptr;
  });
}

}  // namespace msda
