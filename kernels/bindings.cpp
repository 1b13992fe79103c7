// Torch binding of the CUDA C++ baselines. Only torch/extension.h here (no CUDA or ATen-CUDA headers), so this
// file compiles against a CPU-only torch too; the caller passes the current CUDA stream as an integer.
#include <torch/extension.h>

#include <map>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "msda_baselines.h"

namespace {

int dtype_code(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return msda::kF32;
    case torch::kFloat16: return msda::kF16;
    case torch::kBFloat16: return msda::kBF16;
    default: TORCH_CHECK(false, "value must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return -1;
}

void check(const char* message) { TORCH_CHECK(message == nullptr, message ? message : ""); }

void check_cuda_contiguous(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Validates the shapes and fills a Problem. host_shapes/host_starts (flattened (H, W) pairs and level starts) are
// only needed by tma and distributed; the other kernels read spatial_shapes and level_start_index on the device.
msda::Problem make_problem(const torch::Tensor& value, const torch::Tensor& spatial_shapes,
                           const torch::Tensor& level_start_index, const torch::Tensor& sampling_locations,
                           const torch::Tensor& attention_weights, const torch::Tensor& out,
                           const std::vector<int64_t>& host_shapes, const std::vector<int64_t>& host_starts,
                           int64_t stream) {
  check_cuda_contiguous(value, "value");
  check_cuda_contiguous(spatial_shapes, "spatial_shapes");
  check_cuda_contiguous(level_start_index, "level_start_index");
  check_cuda_contiguous(sampling_locations, "sampling_locations");
  check_cuda_contiguous(attention_weights, "attention_weights");
  check_cuda_contiguous(out, "out");
  TORCH_CHECK(value.dim() == 4, "value must be (N, S, M, D)");
  TORCH_CHECK(sampling_locations.dim() == 6 && sampling_locations.size(5) == 2,
              "sampling_locations must be (N, Lq, M, L, P, 2)");
  TORCH_CHECK(spatial_shapes.scalar_type() == torch::kInt64 && level_start_index.scalar_type() == torch::kInt64,
              "spatial_shapes and level_start_index must be int64");
  TORCH_CHECK(sampling_locations.scalar_type() == torch::kFloat32 &&
                  attention_weights.scalar_type() == torch::kFloat32,
              "the baselines take float32 sampling_locations and attention_weights");
  TORCH_CHECK(out.scalar_type() == value.scalar_type(), "out must have value's dtype");
  msda::Problem pb;
  pb.N = value.size(0);
  pb.S = value.size(1);
  pb.M = value.size(2);
  pb.D = value.size(3);
  pb.Lq = sampling_locations.size(1);
  pb.L = sampling_locations.size(3);
  pb.P = sampling_locations.size(4);
  TORCH_CHECK(sampling_locations.size(0) == pb.N && sampling_locations.size(2) == pb.M,
              "sampling_locations does not match value");
  TORCH_CHECK(attention_weights.sizes() == sampling_locations.sizes().slice(0, 5),
              "attention_weights must be (N, Lq, M, L, P)");
  TORCH_CHECK(spatial_shapes.size(0) == pb.L && level_start_index.size(0) == pb.L, "L levels expected");
  TORCH_CHECK(out.numel() == pb.N * pb.Lq * pb.M * pb.D, "out must be (N, Lq, M*D)");
  if (!host_shapes.empty()) {
    TORCH_CHECK((int64_t)host_shapes.size() == 2 * pb.L && (int64_t)host_starts.size() == pb.L,
                "host shapes: 2*L sizes and L starts expected");
    int64_t pixels = 0;
    for (int64_t l = 0; l < pb.L; ++l) {
      TORCH_CHECK(host_starts[l] == pixels, "level_start_index must be the running sum of H*W");
      pixels += host_shapes[2 * l] * host_shapes[2 * l + 1];
    }
    TORCH_CHECK(pixels == pb.S, "sum of H*W over levels must equal S");
  }
  pb.value = value.data_ptr();
  pb.spatial_shapes = spatial_shapes.data_ptr<int64_t>();
  pb.level_start = level_start_index.data_ptr<int64_t>();
  pb.host_shapes = host_shapes.empty() ? nullptr : host_shapes.data();
  pb.host_starts = host_starts.empty() ? nullptr : host_starts.data();
  pb.loc = sampling_locations.data_ptr<float>();
  pb.attn = attention_weights.data_ptr<float>();
  pb.out = out.data_ptr();
  pb.dtype = dtype_code(value);
  pb.stream = reinterpret_cast<void*>(stream);
  return pb;
}

#define MSDA_DEVICE_SHAPE_OP(NAME)                                                                                  \
  void NAME(const torch::Tensor& value, const torch::Tensor& spatial_shapes, const torch::Tensor& level_start_index, \
            const torch::Tensor& sampling_locations, const torch::Tensor& attention_weights, torch::Tensor& out,     \
            int64_t stream) {                                                                                       \
    const msda::Problem pb = make_problem(value, spatial_shapes, level_start_index, sampling_locations,             \
                                          attention_weights, out, {}, {}, stream);                                  \
    check(msda::launch_##NAME(pb));                                                                                 \
  }
MSDA_DEVICE_SHAPE_OP(classic)
MSDA_DEVICE_SHAPE_OP(vec)
MSDA_DEVICE_SHAPE_OP(tile2x2)
#undef MSDA_DEVICE_SHAPE_OP

void tma(const torch::Tensor& value, const torch::Tensor& spatial_shapes, const torch::Tensor& level_start_index,
         const torch::Tensor& sampling_locations, const torch::Tensor& attention_weights, torch::Tensor& out,
         const std::vector<int64_t>& host_shapes, const std::vector<int64_t>& host_starts, int64_t stream) {
  const msda::Problem pb = make_problem(value, spatial_shapes, level_start_index, sampling_locations,
                                        attention_weights, out, host_shapes, host_starts, stream);
  check(msda::launch_tma(pb));
}

void distributed(const torch::Tensor& value, const torch::Tensor& spatial_shapes,
                 const torch::Tensor& level_start_index, const torch::Tensor& sampling_locations,
                 const torch::Tensor& attention_weights, torch::Tensor& out, const std::vector<int64_t>& host_shapes,
                 const std::vector<int64_t>& host_starts, int64_t cluster_size, int64_t stream) {
  const msda::Problem pb = make_problem(value, spatial_shapes, level_start_index, sampling_locations,
                                        attention_weights, out, host_shapes, host_starts, stream);
  check(msda::launch_distributed(pb, (int)cluster_size));
}

std::map<std::string, int64_t> distributed_info(const torch::Tensor& value, const torch::Tensor& spatial_shapes,
                                                const torch::Tensor& level_start_index,
                                                const torch::Tensor& sampling_locations,
                                                const torch::Tensor& attention_weights, const torch::Tensor& out,
                                                const std::vector<int64_t>& host_shapes,
                                                const std::vector<int64_t>& host_starts, int64_t cluster_size) {
  const msda::Problem pb = make_problem(value, spatial_shapes, level_start_index, sampling_locations,
                                        attention_weights, out, host_shapes, host_starts, 0);
  msda::ClusterInfo info;
  check(msda::distributed_info(pb, (int)cluster_size, &info));
  return {{"cluster_size", info.cluster_size},
          {"smem_bytes", info.smem_bytes},
          {"grid_clusters", info.grid_clusters},
          {"max_active_clusters", info.max_active_clusters},
          {"threads_per_cta", info.threads_per_cta}};
}

void tma_box_check(const torch::Tensor& value, const torch::Tensor& coords, torch::Tensor& out, int64_t stream) {
  check_cuda_contiguous(value, "value");
  check_cuda_contiguous(coords, "coords");
  check_cuda_contiguous(out, "out");
  TORCH_CHECK(value.dim() == 5, "value must be (N, H, W, M, D)");
  TORCH_CHECK(coords.scalar_type() == torch::kInt32 && coords.dim() == 2 && coords.size(1) == 4,
              "coords must be int32 (K, 4): n, head, x0, y0");
  const int64_t K = coords.size(0), D = value.size(4);
  TORCH_CHECK(out.scalar_type() == value.scalar_type() && out.numel() == K * 4 * D, "out must be (K, 2, 2, D)");
  check(msda::tma_box_check(value.data_ptr(), dtype_code(value), value.size(0), value.size(1), value.size(2),
                            value.size(3), D, coords.data_ptr<int32_t>(), K, out.data_ptr(),
                            reinterpret_cast<void*>(stream)));
}

void tile_copy(int64_t method, int64_t batch, const torch::Tensor& value, const torch::Tensor& coords,
               torch::Tensor& out, torch::Tensor& checksum, int64_t blocks, bool write_out, int64_t stream) {
  check_cuda_contiguous(value, "value");
  check_cuda_contiguous(coords, "coords");
  check_cuda_contiguous(checksum, "checksum");
  TORCH_CHECK(value.dim() == 5 && value.size(4) == 32 && value.scalar_type() == torch::kFloat16,
              "value must be fp16 (N, H, W, M, 32)");
  TORCH_CHECK(coords.scalar_type() == torch::kInt32 && coords.dim() == 2 && coords.size(1) == 4,
              "coords must be int32 (K, 4): n, y0, x0, head");
  const int64_t K = coords.size(0);
  if (write_out) {
    check_cuda_contiguous(out, "out");
    TORCH_CHECK(out.scalar_type() == torch::kFloat16 && out.numel() == K * 128, "out must be fp16 (K, 2, 2, 32)");
  }
  TORCH_CHECK(checksum.scalar_type() == torch::kInt32 && checksum.numel() >= blocks * 256,
              "checksum must be int32 with blocks * 256 elements");
  check(msda::tile_copy((int)method, (int)batch, value.data_ptr(), value.size(0), value.size(1), value.size(2),
                        value.size(3), coords.data_ptr<int32_t>(), K, write_out ? out.data_ptr() : nullptr,
                        reinterpret_cast<uint32_t*>(checksum.data_ptr<int32_t>()), (int)blocks, write_out,
                        reinterpret_cast<void*>(stream)));
}

std::vector<int64_t> tile_copy_occupancy(int64_t method, int64_t batch) {
  int blocks_per_sm = 0, threads = 0;
  check(msda::tile_copy_occupancy((int)method, (int)batch, &blocks_per_sm, &threads));
  return {blocks_per_sm, threads};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cute_deform CUDA C++ baselines (classic, vec, tile2x2, tma, distributed) and microbenchmarks";
  m.def("classic", &classic, "one thread per output channel, scalar corner loads");
  m.def("vec", &vec, "8 channels per thread, 16-byte corner loads");
  m.def("tile2x2", &tile2x2, "warp-cooperative 2x2x32 tiles through shared memory");
  m.def("tma", &tma, "one TMA 2x2x32 box per sample, mbarrier completion");
  m.def("distributed", &distributed, "cluster keeps a level in distributed shared memory");
  m.def("distributed_info", &distributed_info, "launch plan and co-residency of the distributed kernel");
  m.def("tma_box_check", &tma_box_check, "copy TMA boxes verbatim (OOB fill / negative coordinate check)");
  m.def("tile_copy", &tile_copy, "2x2x32 fp16 tile copy: method 0 LDG, 1 memcpy_async, 2 TMA");
  m.def("tile_copy_occupancy", &tile_copy_occupancy, "(blocks per SM, threads per block) of a tile copy kernel");
}
