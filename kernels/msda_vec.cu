// vec: 8 channels per thread, one 16-byte load per corner (two for fp32), fp32 accumulation: the design
// principle of the fastest public kernel (DCNv4's flash_deform_attn), without its fp16 locations.
// D/8 neighbouring threads share one (n, q, head); a warp covers 32*8/D heads of one query at D=32.
#include "msda_common.cuh"

namespace msda {
namespace {

template <typename T>
__global__ void __launch_bounds__(256) msda_vec_kernel(
    const T* __restrict__ value, const int64_t* __restrict__ spatial_shapes, const int64_t* __restrict__ level_start,
    const float* __restrict__ loc, const float* __restrict__ attn, T* __restrict__ out, int64_t total, int S, int Lq,
    int M, int D, int L, int P) {
  const int groups = D / 8;
  for (int64_t index = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; index < total;
       index += (int64_t)gridDim.x * blockDim.x) {
    const int group = (int)(index % groups);
    int64_t rest = index / groups;
    const int head = (int)(rest % M);
    rest /= M;  // n * Lq + q
    const int n = (int)(rest / Lq);
    const int64_t sample0 = (rest * M + head) * L * P;
    const int pixel_stride = M * D;
    const T* image = value + (int64_t)n * S * pixel_stride + head * D + group * 8;
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    for (int level = 0; level < L; ++level) {
      const int H = (int)__ldg(spatial_shapes + 2 * level), W = (int)__ldg(spatial_shapes + 2 * level + 1);
      const T* level_value = image + __ldg(level_start + level) * pixel_stride;
      const float2* level_loc = reinterpret_cast<const float2*>(loc) + sample0 + level * P;
      const float* level_attn = attn + sample0 + level * P;
#pragma unroll 2
      for (int point = 0; point < P; ++point) {
        const float2 xy = __ldg(level_loc + point);
        const Footprint f = footprint(xy.x, xy.y, H, W, __ldg(level_attn + point));
        if (!f.valid) continue;
        // Issue all four corner loads before any arithmetic: four 16-byte loads in flight per thread.
        const bool top = f.y0 >= 0, bottom = f.y0 + 1 < H, left = f.x0 >= 0, right = f.x0 + 1 < W;
        const T* p00 = level_value + ((int64_t)f.y0 * W + f.x0) * pixel_stride;
        const Chunk8<T> c00 = (top && left) ? load8(p00) : zero8<T>();
        const Chunk8<T> c01 = (top && right) ? load8(p00 + pixel_stride) : zero8<T>();
        const Chunk8<T> c10 = (bottom && left) ? load8(p00 + (int64_t)W * pixel_stride) : zero8<T>();
        const Chunk8<T> c11 = (bottom && right) ? load8(p00 + (int64_t)(W + 1) * pixel_stride) : zero8<T>();
        fma8(acc, f.w00, c00);
        fma8(acc, f.w01, c01);
        fma8(acc, f.w10, c10);
        fma8(acc, f.w11, c11);
      }
    }
    store8(out + rest * pixel_stride + head * D + group * 8, acc);
  }
}

}  // namespace

const char* launch_vec(const Problem& pb) {
  if (pb.D % 8 != 0) return plain_message("vec needs D to be a multiple of 8");
  return dispatch_dtype(pb.dtype, [&](auto tag) -> const char* {
    using T = decltype(tag);
    const int64_t total = pb.N * pb.Lq * pb.M * (pb.D / 8);
    if (total == 0) return nullptr;
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>(ceil_div(total, threads), (int64_t)1 << 30);
    msda_vec_kernel<T><<<(unsigned)blocks, threads, 0, (cudaStream_t)pb.stream>>>(
        static_cast<const T*>(pb.value), pb.spatial_shapes, pb.level_start, pb.loc, pb.attn, static_cast<T*>(pb.out),
        total, (int)pb.S, (int)pb.Lq, (int)pb.M, (int)pb.D, (int)pb.L, (int)pb.P);
    MSDA_RETURN_IF_ERROR("vec launch", cudaGetLastError());
    return nullptr;
  });
}

}  // namespace msda
