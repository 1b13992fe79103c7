// Device helpers shared by the baselines. No torch headers: the kernels must compile on a CPU-only CI.
// torch builds with __CUDA_NO_HALF_CONVERSIONS__ and friends, so every conversion here is explicit.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <string>
#include <algorithm>

#include "msda_baselines.h"

namespace msda {

inline const char* error_message(const char* where, cudaError_t err) {
  thread_local std::string message;
  if (err == cudaSuccess) return nullptr;
  message = std::string(where) + ": " + cudaGetErrorString(err);
  return message.c_str();
}

inline const char* plain_message(const std::string& text) {
  thread_local std::string message;
  message = text;
  return message.c_str();
}

// Check the launch itself (configuration, resources), not the kernel's completion.
#define MSDA_RETURN_IF_ERROR(where, expr)                              \
  do {                                                                 \
    cudaError_t err_ = (expr);                                         \
    if (err_ != cudaSuccess) return ::msda::error_message(where, err_); \
  } while (0)

// ---- scalar conversions ----
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// ---- 8 channels at a time: one 16-byte access for fp16/bf16, two for fp32 ----
__device__ __forceinline__ void unpack8(const uint4& raw, float (&v)[8], __half) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 f = __half22float2(h[i]); v[2 * i] = f.x; v[2 * i + 1] = f.y; }
}
__device__ __forceinline__ void unpack8(const uint4& raw, float (&v)[8], __nv_bfloat16) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(h[i]); v[2 * i] = f.x; v[2 * i + 1] = f.y; }
}

// Raw 8-channel chunk as it sits in memory, so that loads can be issued before any arithmetic.
template <typename T> struct Chunk8 { uint4 raw; };
template <> struct Chunk8<float> { float4 lo, hi; };

template <typename T> __device__ __forceinline__ Chunk8<T> load8(const T* p) {
  Chunk8<T> c; c.raw = __ldg(reinterpret_cast<const uint4*>(p)); return c;
}
template <> __device__ __forceinline__ Chunk8<float> load8<float>(const float* p) {
  Chunk8<float> c;
  c.lo = __ldg(reinterpret_cast<const float4*>(p));
  c.hi = __ldg(reinterpret_cast<const float4*>(p) + 1);
  return c;
}
// Plain (non-__ldg) load, for generic pointers into distributed shared memory.
template <typename T> __device__ __forceinline__ Chunk8<T> load8_generic(const T* p) {
  Chunk8<T> c; c.raw = *reinterpret_cast<const uint4*>(p); return c;
}
template <> __device__ __forceinline__ Chunk8<float> load8_generic<float>(const float* p) {
  Chunk8<float> c;
  c.lo = reinterpret_cast<const float4*>(p)[0];
  c.hi = reinterpret_cast<const float4*>(p)[1];
  return c;
}
template <typename T> __device__ __forceinline__ Chunk8<T> zero8() {
  Chunk8<T> c; c.raw = make_uint4(0, 0, 0, 0); return c;
}
template <> __device__ __forceinline__ Chunk8<float> zero8<float>() {
  Chunk8<float> c; c.lo = make_float4(0.f, 0.f, 0.f, 0.f); c.hi = c.lo; return c;
}

template <typename T> __device__ __forceinline__ void fma8(float (&acc)[8], float w, const Chunk8<T>& c) {
  float v[8];
  unpack8(c.raw, v, T());
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, v[i], acc[i]);
}
template <> __device__ __forceinline__ void fma8<float>(float (&acc)[8], float w, const Chunk8<float>& c) {
  acc[0] = fmaf(w, c.lo.x, acc[0]); acc[1] = fmaf(w, c.lo.y, acc[1]);
  acc[2] = fmaf(w, c.lo.z, acc[2]); acc[3] = fmaf(w, c.lo.w, acc[3]);
  acc[4] = fmaf(w, c.hi.x, acc[4]); acc[5] = fmaf(w, c.hi.y, acc[5]);
  acc[6] = fmaf(w, c.hi.z, acc[6]); acc[7] = fmaf(w, c.hi.w, acc[7]);
}

template <typename T> __device__ __forceinline__ void store8(T* p, const float (&acc)[8]);
template <> __device__ __forceinline__ void store8<__half>(__half* p, const float (&acc)[8]) {
  uint4 raw;
  __half2* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(acc[2 * i], acc[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
template <> __device__ __forceinline__ void store8<__nv_bfloat16>(__nv_bfloat16* p, const float (&acc)[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}
template <> __device__ __forceinline__ void store8<float>(float* p, const float (&acc)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

// ---- one sample's bilinear footprint, the original Deformable-DETR rule ----
// h = y*H - 0.5, w = x*W - 0.5; the sample counts only if -1 < h < H and -1 < w < W (a NaN fails this).
// Corner order: (y0,x0), (y0,x0+1), (y0+1,x0), (y0+1,x0+1); each weight already carries the attention weight.
struct Footprint {
  bool valid;
  int y0, x0;
  float w00, w01, w10, w11;
};

__device__ __forceinline__ Footprint footprint(float x, float y, int H, int W, float attn) {
  Footprint f;
  const float h = y * H - 0.5f;
  const float w = x * W - 0.5f;
  f.valid = h > -1.f && w > -1.f && h < (float)H && w < (float)W;
  const float hf = floorf(h), wf = floorf(w);
  f.y0 = f.valid ? (int)hf : 0;  // an invalid sample may hold NaN or huge values: keep the ints tame
  f.x0 = f.valid ? (int)wf : 0;
  const float lh = h - hf, lw = w - wf, hh = 1.f - lh, hw = 1.f - lw;
  f.w00 = hh * hw * attn;
  f.w01 = hh * lw * attn;
  f.w10 = lh * hw * attn;
  f.w11 = lh * lw * attn;
  return f;
}

__device__ __forceinline__ bool inside(int y, int x, int H, int W) {
  return y >= 0 && y < H && x >= 0 && x < W;
}

// Calls fn(T{}) with T the value's element type.
template <typename Fn> inline const char* dispatch_dtype(int dtype, Fn&& fn) {
  switch (dtype) {
    case kF32: return fn(float());
    case kF16: return fn(__half());
    case kBF16: return fn(__nv_bfloat16());
    default: return plain_message("unsupported value dtype code " + std::to_string(dtype));
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace msda
