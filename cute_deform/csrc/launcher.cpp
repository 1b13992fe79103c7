// The CUDA and Autograd kernels of torch.ops.cute_deform.forward and forward_fused, in C++.
//
// A call whose launch the Python side planned before (same dtypes, sizes and device, no tuning) runs
// the compiled kernel through its TVM-FFI entry point from here: no Python on the hot path. Every
// other call (a new size, a CPU level table seen for the first time, an unaligned or strided input, a
// bad input) goes to the Python implementation, registered as cute_deform::_forward_python and
// cute_deform::_forward_fused_python, which checks, plans, launches and registers the launch here.
//
// Built and loaded by cute_deform/native.py (torch.utils.cpp_extension); the op schemas stay in Python.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <array>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cute_deform {
namespace {

// ---------------------------------------------------------------------------------------------------
// Launch registry: what the Python side worked out for one kind of call.
// ---------------------------------------------------------------------------------------------------
struct LaunchKey {
  // fused, value, sampling (locations or offsets), weights (or logits), reference points' dtype
  // (-1 unfused) and coordinates, device index
  std::array<int8_t, 7> kind;
  std::array<int64_t, 7> sizes;  // N, S, M, D, Lq, L, P

  bool operator==(const LaunchKey& other) const { return kind == other.kind && sizes == other.sizes; }
};

struct LaunchKeyHash {
  size_t operator()(const LaunchKey& key) const {
    size_t h = 0;
    for (int8_t k : key.kind) h = h * 31 + static_cast<uint8_t>(k);
    for (int64_t s : key.sizes) h = h * 1000003 + static_cast<size_t>(s);
    return h;
  }
};

struct Launch {
  TVMFFIObjectHandle function = nullptr;  // a reference held here (TVMFFIObjectIncRef)
  bool generic = false;                   // the generic kernel's argument list
  int64_t grid = 0, rounds = 0, whole = 0;
  at::Tensor order, maps;  // arguments the compiled configuration never reads (the tiled kernel)
};

std::mutex registry_mutex;
std::unordered_map<LaunchKey, Launch, LaunchKeyHash> registry;

// Device copies of level tables given on the CPU, by device and values (as the Python side keeps them).
struct TableKey {
  int8_t device;
  std::vector<int64_t> values;  // H, W per level, then the starts
  bool operator==(const TableKey& other) const { return device == other.device && values == other.values; }
};
struct TableKeyHash {
  size_t operator()(const TableKey& key) const {
    size_t h = static_cast<size_t>(key.device);
    for (int64_t v : key.values) h = h * 1000003 + static_cast<size_t>(v);
    return h;
  }
};
std::unordered_map<TableKey, std::pair<at::Tensor, at::Tensor>, TableKeyHash> device_tables;
constexpr size_t kMaxEntries = 4096;  // sizes that keep changing must not grow the maps without bound

int8_t dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: return -1;
  }
}

LaunchKey key_of(const at::Tensor& value, const at::Tensor& sampling, const at::Tensor& weights,
                 const c10::optional<at::Tensor>& reference) {
  LaunchKey key;
  key.kind = {static_cast<int8_t>(reference.has_value()), dtype_code(value), dtype_code(sampling),
              dtype_code(weights), reference ? dtype_code(*reference) : int8_t(-1),
              reference ? static_cast<int8_t>(reference->size(-1)) : int8_t(0),
              static_cast<int8_t>(value.get_device())};
  key.sizes = {value.size(0), value.size(1), value.size(2), value.size(3),
               sampling.size(1), sampling.size(3), sampling.size(4)};
  return key;
}

void clear_registry() {
  for (auto& entry : registry) TVMFFIObjectDecRef(entry.second.function);
  registry.clear();
}

// cute_deform::_native_register: called by the Python side after a launch it may hand over.
void native_register(const at::Tensor& value, const at::Tensor& sampling, const at::Tensor& weights,
                     const c10::optional<at::Tensor>& reference, int64_t function, int64_t generic, int64_t grid,
                     int64_t rounds, int64_t whole, const at::Tensor& order, const at::Tensor& maps) {
  TORCH_CHECK(function != 0, "cute_deform::_native_register: function: expected a TVM-FFI function handle, got 0");
  Launch launch;
  launch.function = reinterpret_cast<TVMFFIObjectHandle>(function);
  launch.generic = generic != 0;
  launch.grid = grid;
  launch.rounds = rounds;
  launch.whole = whole;
  launch.order = order;
  launch.maps = maps;
  TVMFFIObjectIncRef(launch.function);
  LaunchKey key = key_of(value, sampling, weights, reference);
  std::lock_guard<std::mutex> lock(registry_mutex);
  if (registry.size() >= kMaxEntries) clear_registry();
  auto found = registry.find(key);
  if (found != registry.end()) {
    TVMFFIObjectDecRef(found->second.function);
    found->second = std::move(launch);
  } else {
    registry.emplace(key, std::move(launch));
  }
}

void native_clear() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  clear_registry();
  device_tables.clear();
}

int64_t native_entries() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  return static_cast<int64_t>(registry.size());
}

// ---------------------------------------------------------------------------------------------------
// The fast path
// ---------------------------------------------------------------------------------------------------
// What the kernels take: a dense, row-major tensor whose data is 16-byte aligned.
bool dense(const at::Tensor& t) {
  return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

bool on(const at::Tensor& t, const c10::Device& device) { return t.device() == device; }

// Level tables on value's device for the kernel, or false where the Python side must take the call.
// Tables on the CPU are checked here as the Python checks do (H, W >= 1, S = sum of H*W, the starts the
// running sum); a mismatch goes to Python, which raises with its message.
bool level_tables(const at::Tensor& shapes, const at::Tensor& starts, const at::Tensor& value, int64_t L,
                  at::Tensor& shapes_out, at::Tensor& starts_out) {
  if (shapes.scalar_type() != at::kLong || starts.scalar_type() != at::kLong || shapes.dim() != 2 ||
      shapes.size(0) != L || shapes.size(1) != 2 || starts.dim() != 1 || starts.size(0) != L)
    return false;
  const c10::Device device = value.device();
  if (on(shapes, device) && on(starts, device)) {
    if (!shapes.is_contiguous() || !starts.is_contiguous()) return false;
    shapes_out = shapes;
    starts_out = starts;
    return true;
  }
  if (!shapes.is_cpu() || !starts.is_cpu()) return false;
  TableKey key{static_cast<int8_t>(value.get_device()), {}};
  key.values.reserve(3 * L);
  const at::Tensor shapes_c = shapes.contiguous(), starts_c = starts.contiguous();
  const int64_t* hw = shapes_c.data_ptr<int64_t>();
  const int64_t* st = starts_c.data_ptr<int64_t>();
  int64_t start = 0;
  for (int64_t level = 0; level < L; ++level) {
    const int64_t height = hw[2 * level], width = hw[2 * level + 1];
    if (height < 1 || width < 1 || st[level] != start) return false;
    start += height * width;
    key.values.push_back(height);
    key.values.push_back(width);
  }
  if (start != value.size(1)) return false;
  key.values.insert(key.values.end(), st, st + L);
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto found = device_tables.find(key);
  if (found == device_tables.end()) {
    if (device_tables.size() >= kMaxEntries) device_tables.clear();
    // Copied once per distinct table and device (a warm-up call before CUDA graph capture makes it).
    found = device_tables.emplace(key, std::make_pair(shapes_c.to(device), starts_c.to(device))).first;
  }
  shapes_out = found->second.first;
  starts_out = found->second.second;
  return true;
}

struct DLArg {
  DLTensor tensor;
  std::array<int64_t, 6> strides;
};

void describe(DLArg& arg, const at::Tensor& t) {
  DLTensor& d = arg.tensor;
  d.data = t.data_ptr();
  d.device = DLDevice{kDLCUDA, static_cast<int32_t>(t.get_device())};
  d.ndim = static_cast<int32_t>(t.dim());
  switch (t.scalar_type()) {
    case at::kFloat: d.dtype = DLDataType{kDLFloat, 32, 1}; break;
    case at::kHalf: d.dtype = DLDataType{kDLFloat, 16, 1}; break;
    case at::kBFloat16: d.dtype = DLDataType{kDLBfloat, 16, 1}; break;
    default: d.dtype = DLDataType{kDLInt, 64, 1}; break;  // the level tables and placeholders
  }
  d.shape = const_cast<int64_t*>(t.sizes().data());
  // Row-major strides (torch may keep any stride on a dimension of size 1 of a contiguous tensor).
  int64_t stride = 1;
  for (int dim = d.ndim - 1; dim >= 0; --dim) {
    arg.strides[dim] = stride;
    stride *= t.size(dim);
  }
  d.strides = arg.strides.data();
  d.byte_offset = 0;
}

void set_tensor(TVMFFIAny& any, DLArg& arg) {
  std::memset(&any, 0, sizeof(any));
  any.type_index = kTVMFFIDLTensorPtr;
  any.v_ptr = &arg.tensor;
}

void set_int(TVMFFIAny& any, int64_t v) {
  std::memset(&any, 0, sizeof(any));
  any.type_index = kTVMFFIInt;
  any.v_int64 = v;
}

[[noreturn]] void raise_ffi_error(const char* what) {
  TVMFFIObjectHandle error = nullptr;
  TVMFFIErrorMoveFromRaised(&error);
  std::string message = std::string("cute_deform: ") + what + " failed";
  if (error != nullptr) {
    const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(error);
    message += ": " + std::string(cell->kind.data, cell->kind.size) + ": " +
               std::string(cell->message.data, cell->message.size);
    TVMFFIObjectDecRef(error);
  }
  TORCH_CHECK(false, message);
}

// Runs the registered launch; false where there is none (the caller hands the call to Python).
bool try_launch(const at::Tensor& value, const at::Tensor& shapes, const at::Tensor& starts,
                const at::Tensor& sampling, const at::Tensor& weights, const c10::optional<at::Tensor>& reference,
                at::Tensor& out) {
  if (!value.is_cuda() || value.dim() != 4 || sampling.dim() != 6 || weights.dim() != 5) return false;
  const c10::Device device = value.device();
  if (!on(sampling, device) || !on(weights, device) || !dense(value) || !dense(sampling) || !dense(weights))
    return false;
  const int64_t N = value.size(0), M = value.size(2), Lq = sampling.size(1), L = sampling.size(3),
                P = sampling.size(4);
  if (sampling.size(0) != N || sampling.size(2) != M || sampling.size(5) != 2 ||
      weights.sizes() != at::IntArrayRef({N, Lq, M, L, P}))
    return false;
  if (reference) {
    const at::Tensor& ref = *reference;
    if (ref.dim() != 4 || !on(ref, device) || !dense(ref) || ref.size(0) != N || ref.size(1) != Lq ||
        ref.size(2) != L || (ref.size(3) != 2 && ref.size(3) != 4) || dtype_code(ref) < 0)
      return false;
  }
  if (dtype_code(value) < 0 || dtype_code(sampling) < 0 || dtype_code(weights) < 0) return false;

  Launch launch;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto found = registry.find(key_of(value, sampling, weights, reference));
    if (found == registry.end()) return false;
    launch = found->second;
  }
  at::Tensor shapes_d, starts_d;
  if (!level_tables(shapes, starts, value, L, shapes_d, starts_d)) return false;

  c10::DeviceGuard guard(device);
  out = at::empty({N, Lq, M * value.size(3)}, value.options());
  const at::Tensor& third = reference ? *reference : sampling;

  DLArg tensors[9];
  TVMFFIAny args[12];
  int count = 0;
  const at::Tensor* order[] = {&value, &shapes_d, &starts_d, &sampling, &weights, &third};
  for (const at::Tensor* t : order) {
    describe(tensors[count], *t);
    set_tensor(args[count], tensors[count]);
    ++count;
  }
  if (launch.generic) {
    describe(tensors[count], out);
    set_tensor(args[count], tensors[count]);
    ++count;
    set_int(args[count++], launch.grid);
  } else {
    for (const at::Tensor* t : {&launch.order, &out, &launch.maps}) {
      describe(tensors[count], *t);
      set_tensor(args[count], tensors[count]);
      ++count;
    }
    set_int(args[count++], launch.grid);
    set_int(args[count++], launch.rounds);
    set_int(args[count++], launch.whole);
  }

  // The kernel launches on the stream TVM-FFI's environment holds for the device: torch's current one.
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  const int32_t device_id = static_cast<int32_t>(device.index());
  TVMFFIStreamHandle previous = nullptr;
  if (TVMFFIEnvSetStream(kDLCUDA, device_id, stream.native_handle(), &previous) != 0)
    raise_ffi_error("setting the TVM-FFI stream");
  TVMFFIAny result;
  std::memset(&result, 0, sizeof(result));
  result.type_index = kTVMFFINone;
  const int status = TVMFFIFunctionCall(launch.function, args, count, &result);
  if (previous != stream.native_handle()) TVMFFIEnvSetStream(kDLCUDA, device_id, previous, nullptr);
  if (status != 0) raise_ffi_error("the kernel launch");
  return true;
}

// ---------------------------------------------------------------------------------------------------
// The op's kernels
// ---------------------------------------------------------------------------------------------------
// The backward's refusals: Python's (cute_deform/_checks.py), handed over when the launcher loads.
std::string forward_only_message = "cute_deform.forward is forward only";
std::string fused_forward_only_message = "cute_deform.forward_fused is forward only";

void native_set_messages(std::string forward, std::string forward_fused) {
  forward_only_message = std::move(forward);
  fused_forward_only_message = std::move(forward_fused);
}

// What differs between the two ops besides their arguments: names, signature and the backward's message.
struct Forward {
  static constexpr const char* name = "cute_deform::forward";
  static constexpr const char* python = "cute_deform::_forward_python";
  static const std::string& forward_only() { return forward_only_message; }
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, int64_t);
};

struct ForwardFused {
  static constexpr const char* name = "cute_deform::forward_fused";
  static constexpr const char* python = "cute_deform::_forward_fused_python";
  static const std::string& forward_only() { return fused_forward_only_message; }
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&);
};

template <typename Op>
const c10::TypedOperatorHandle<typename Op::Signature>& op_handle() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, "").template typed<typename Op::Signature>();
  return op;
}

// The Python kernel, for what try_launch does not take.
template <typename Op>
const c10::TypedOperatorHandle<typename Op::Signature>& python_handle() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(Op::python, "").template typed<typename Op::Signature>();
  return op;
}

at::Tensor forward_cuda(const at::Tensor& value, const at::Tensor& spatial_shapes,
                        const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                        const at::Tensor& attention_weights, int64_t im2col_step) {
  at::Tensor out;
  if (try_launch(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, c10::nullopt, out))
    return out;
  return python_handle<Forward>().call(value, spatial_shapes, level_start_index, sampling_locations,
                                       attention_weights, im2col_step);
}

at::Tensor forward_fused_cuda(const at::Tensor& value, const at::Tensor& spatial_shapes,
                              const at::Tensor& level_start_index, const at::Tensor& reference_points,
                              const at::Tensor& sampling_offsets, const at::Tensor& attention_logits) {
  at::Tensor out;
  if (try_launch(value, spatial_shapes, level_start_index, sampling_offsets, attention_logits, reference_points, out))
    return out;
  return python_handle<ForwardFused>().call(value, spatial_shapes, level_start_index, reference_points,
                                            sampling_offsets, attention_logits);
}

// The op below the autograd layer (the CUDA kernel above, or the CPU / fake / other ones).
template <typename Op, typename... Args>
at::Tensor redispatch(const Args&... args) {
  at::AutoDispatchBelowADInplaceOrView below;
  return op_handle<Op>().call(args...);
}

// Forward only: an output computed from inputs that require grad gets a grad_fn whose backward raises.
template <typename Op>
struct ForwardOnly : public torch::autograd::Function<ForwardOnly<Op>> {
  template <typename... Args>
  static at::Tensor forward(torch::autograd::AutogradContext*, const Args&... args) {
    return redispatch<Op>(args...);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    TORCH_CHECK(false, Op::forward_only());
  }
};

bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
bool requires_grad(int64_t) { return false; }

template <typename Op, typename... Args>
at::Tensor autograd_kernel(const Args&... args) {
  if (c10::GradMode::is_enabled() && (requires_grad(args) || ...)) return ForwardOnly<Op>::apply(args...);
  return redispatch<Op>(args...);
}

at::Tensor forward_autograd(const at::Tensor& value, const at::Tensor& spatial_shapes,
                            const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                            const at::Tensor& attention_weights, int64_t im2col_step) {
  return autograd_kernel<Forward>(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                                  im2col_step);
}

at::Tensor forward_fused_autograd(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                  const at::Tensor& level_start_index, const at::Tensor& reference_points,
                                  const at::Tensor& sampling_offsets, const at::Tensor& attention_logits) {
  return autograd_kernel<ForwardFused>(value, spatial_shapes, level_start_index, reference_points,
                                       sampling_offsets, attention_logits);
}

}  // namespace
}  // namespace cute_deform

TORCH_LIBRARY_FRAGMENT(cute_deform, m) {
  m.def(
      "_native_register(Tensor value, Tensor sampling, Tensor weights, Tensor? reference_points, int function, "
      "int generic, int grid, int rounds, int whole, Tensor order, Tensor maps) -> ()",
      &cute_deform::native_register);
  m.def("_native_clear() -> ()", &cute_deform::native_clear);
  m.def("_native_set_messages(str forward, str forward_fused) -> ()", &cute_deform::native_set_messages);
  m.def("_native_entries() -> int", &cute_deform::native_entries);
}

TORCH_LIBRARY_IMPL(cute_deform, CUDA, m) {
  m.impl("forward", &cute_deform::forward_cuda);
  m.impl("forward_fused", &cute_deform::forward_fused_cuda);
}

TORCH_LIBRARY_IMPL(cute_deform, Autograd, m) {
  m.impl("forward", &cute_deform::forward_autograd);
  m.impl("forward_fused", &cute_deform::forward_fused_autograd);
}
