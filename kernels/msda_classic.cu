// classic: the paper's kernel design. One thread per output channel (n, q, head, channel), scalar loads,
// four separate corner loads per sample, levels and points looped inside the thread. Accumulates in fp32
// (the original accumulates in the value's type; fp32 keeps fp16/bf16 within the error bound).
#include "msda_common.cuh"

namespace msda {
namespace {

// Bilinear sample of one channel at (h, w) of one level, as the original: each corner loaded on its own.
template <typename T>
__device__ __forceinline__ float bilinear_channel(const T* __restrict__ level_value, int H, int W, int pixel_stride,
                                                  float h, float w) {
  const int h_low = (int)floorf(h), w_low = (int)floorf(w);
  const int h_high = h_low + 1, w_high = w_low + 1;
  const float lh = h - h_low, lw = w - w_low, hh = 1.f - lh, hw = 1.f - lw;
  float v1 = 0.f, v2 = 0.f, v3 = 0.f, v4 = 0.f;
  if (h_low >= 0 && w_low >= 0) v1 = to_float(level_value[(int64_t)(h_low * W + w_low) * pixel_stride]);
  if (h_low >= 0 && w_high <= W - 1) v2 = to_float(level_value[(int64_t)(h_low * W + w_high) * pixel_stride]);
  if (h_high <= H - 1 && w_low >= 0) v3 = to_float(level_value[(int64_t)(h_high * W + w_low) * pixel_stride]);
  if (h_high <= H - 1 && w_high <= W - 1) v4 = to_float(level_value[(int64_t)(h_high * W + w_high) * pixel_stride]);
  return hh * hw * v1 + hh * lw * v2 + lh * hw * v3 + lh * lw * v4;
}

template <typename T>
__global__ void __launch_bounds__(256) msda_classic_kernel(
    const T* __restrict__ value, const int64_t* __restrict__ spatial_shapes, const int64_t* __restrict__ level_start,
    const float* __restrict__ loc, const float* __restrict__ attn, T* __restrict__ out, int64_t total, int S, int Lq,
    int M, int D, int L, int P) {
  for (int64_t index = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; index < total;
       index += (int64_t)gridDim.x * blockDim.x) {
    const int channel = (int)(index % D);
    int64_t rest = index / D;
    const int head = (int)(rest % M);
    rest /= M;                       // rest = n * Lq + q
    const int n = (int)(rest / Lq);
    const int64_t sample0 = (rest * M + head) * L * P;  // first (level, point) of this (n, q, head)
    const int pixel_stride = M * D;
    const T* image = value + (int64_t)n * S * pixel_stride + head * D + channel;
    float acc = 0.f;
    for (int level = 0; level < L; ++level) {
      const int H = (int)spatial_shapes[2 * level], W = (int)spatial_shapes[2 * level + 1];
      const T* level_value = image + level_start[level] * pixel_stride;
      for (int point = 0; point < P; ++point) {
        const int64_t sample = sample0 + level * P + point;
        const float x = loc[2 * sample], y = loc[2 * sample + 1];
        const float a = attn[sample];
        const float h = y * H - 0.5f, w = x * W - 0.5f;
        if (h > -1.f && w > -1.f && h < (float)H && w < (float)W)
          acc += a * bilinear_channel(level_value, H, W, pixel_stride, h, w);
      }
    }
    out[index] = from_float<T>(acc);
  }
}

}  // namespace

const char* launch_classic(const Problem& pb) {
  return dispatch_dtype(pb.dtype, [&](auto tag) -> const char* {
    using T = decltype(tag);
    const int64_t total = pb.N * pb.Lq * pb.M * pb.D;
    if (total == 0) return nullptr;
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>(ceil_div(total, threads), (int64_t)1 << 30);
    msda_classic_kernel<T><<<(unsigned)blocks, threads, 0, (cudaStream_t)pb.stream>>>(
        static_cast<const T*>(pb.value), pb.spatial_shapes, pb.level_start, pb.loc, pb.attn, static_cast<T*>(pb.out),
        total, (int)pb.S, (int)pb.Lq, (int)pb.M, (int)pb.D, (int)pb.L, (int)pb.P);
    MSDA_RETURN_IF_ERROR("classic launch", cudaGetLastError());
    return nullptr;
  });
}

}  // namespace msda
