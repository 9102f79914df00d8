// The CUDA kernels of cute_fa::fwd and cute_fa::bwd, on the host side, in C++.
//
// Why: a compiled training step without a CUDA graph is paced by its host
// (docs/findings.md, "Host path"), and the Python kernels of the ops cost
// ~80 us (fwd) and ~155 us (bwd) of host time per call on the H100 machine,
// against ~55 us for SDPA's cuDNN forward. Here the same work (checks, plan
// lookup, TMA-ready inputs, allocation, NVTX range, TVM-FFI launches) runs
// without the interpreter.
//
// What is launched how is the launch plan's (launch_plan.h), run here and by
// the op's Python path alike; tests/test_native_gpu.py checks the two
// bitwise against each other. What stays in Python (python_api/native.py):
// choosing a problem's config and compiling its kernels, called once per new
// problem through the planner callbacks; every call that fails the fast
// check (the op's Python CUDA kernel raises the error that names the
// argument, or runs a valid call this path does not take: padded head dims);
// the fake and CPU kernels and autograd.

#include <torch/extension.h>
#include <torch/library.h>
#include <torch/version.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <nvtx3/nvToolsExt.h>

#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "launch_plan.h"
#include "plan_launcher.h"

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------- TVM-FFI

DLDataType dl_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return {kDLBfloat, 16, 1};
    case at::kHalf: return {kDLFloat, 16, 1};
    case at::kFloat: return {kDLFloat, 32, 1};
    case at::kInt: return {kDLInt, 32, 1};
    default: TORCH_CHECK(false, "cute_fa native: unexpected dtype ", t);
  }
}

// A DLTensor view of an at::Tensor; shape and strides point into the tensor,
// which outlives the call.
DLTensor dl_view(const at::Tensor& t) {
  DLTensor d;
  d.data = t.data_ptr();
  d.device = {kDLCUDA, static_cast<int32_t>(t.device().index())};
  d.ndim = static_cast<int32_t>(t.dim());
  d.dtype = dl_dtype(t.scalar_type());
  d.shape = const_cast<int64_t*>(t.sizes().data());
  d.strides = const_cast<int64_t*>(t.strides().data());
  d.byte_offset = 0;
  return d;
}

class NvtxRange {
 public:
  explicit NvtxRange(const std::string& name) { nvtxRangePushA(name.c_str()); }
  ~NvtxRange() { nvtxRangePop(); }
};

// ------------------------------------------------------------- the plans

// The compiled launches of one kernel variant, from the Python planner.
// Never released: they are the compile cache's, which lives as long as the
// process, and must not be released after the interpreter has shut down.
struct KernelSet {
  std::vector<TVMFFIObjectHandle> launches;  // in the plan's kernel order
};

// What one problem needs at launch time.
struct PlanEntry {
  CuteFaPlan plan;
  const KernelSet* kernels = nullptr;
  std::string nvtx_name;
  at::Tensor unused_i32, unused_f32;  // stand in for the buffers the variant never reads
};

// device, dtype, the shape (7), causal, deterministic, LSE gradient (0: a
// forward), window left and right, softcap > 0, sinks
using PlanKey = std::array<int64_t, 16>;

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 0;
    for (int64_t x : k) h = h * 1000003u ^ std::hash<int64_t>()(x);
    return h;
  }
};

// The plans of recent problems, least recently used evicted beyond
// kMaxPlans (a server with ever new sequence lengths would otherwise grow
// without bound). Entries are shared: an evicted plan stays valid for the
// call that holds it.
constexpr size_t kMaxPlans = 512;

struct State {
  // The autograd engine runs backward ops on its own thread: the cache is
  // guarded, and never while the GIL is taken (a planner runs Python).
  std::mutex mutex;
  std::list<std::pair<PlanKey, std::shared_ptr<const PlanEntry>>> recent;  // front: newest
  std::unordered_map<PlanKey, decltype(recent)::iterator, PlanKeyHash> plans;
  std::unordered_map<PyObject*, std::unique_ptr<KernelSet>> kernel_sets;
  PyObject* fwd_planner = nullptr;
  PyObject* bwd_planner = nullptr;
  PyObject* fallback_fwd = nullptr;
  PyObject* fallback_bwd = nullptr;
};

// Leaked on purpose: it holds Python objects, which must not be released
// after the interpreter has shut down.
State& state() {
  static State* s = new State();
  return *s;
}

// The kernel set of the planner's `kernels` object (held for the process).
const KernelSet* kernel_set(State& s, py::handle kernels, py::handle handles) {
  std::lock_guard<std::mutex> lock(s.mutex);
  auto& slot = s.kernel_sets[kernels.ptr()];
  if (!slot) {
    slot = std::make_unique<KernelSet>();
    for (py::handle h : handles)
      slot->launches.push_back(reinterpret_cast<TVMFFIObjectHandle>(h.cast<uintptr_t>()));
    Py_INCREF(kernels.ptr());
  }
  return slot.get();
}

template <typename Variant>
Variant read_variant(py::handle variant) {
  const std::string bytes = variant.cast<py::bytes>();
  TORCH_CHECK(bytes.size() == sizeof(Variant), "cute_fa native: the planner's variant has ",
              bytes.size(), " bytes, launch_plan.h's ", sizeof(Variant));
  Variant v;
  std::memcpy(&v, bytes.data(), sizeof(Variant));
  return v;
}

// The fast acceptance of scores.check_score_args and check_sink: windows,
// a softcap and learnable sinks that the naming checks let through.
bool score_args_ok(int64_t window_left, int64_t window_right, double softcap,
                   const std::optional<at::Tensor>& sink, const at::Tensor& q) {
  if (window_left < -1 || window_right < -1) return false;
  if (!(softcap >= 0.0 && std::isfinite(softcap))) return false;
  if (!sink) return true;
  const auto t = sink->scalar_type();
  return sink->dim() == 1 && sink->size(0) == q.size(2) && sink->device() == q.device() &&
         (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf);
}

// The sinks as the kernels read them: fp32 (1, 1, nheads) (ops.sink_input).
at::Tensor sink_input(const at::Tensor& sink) {
  return sink.to(at::kFloat).contiguous().view({1, 1, -1});
}

// Asks the Python planner (which compiles the kernels the first time) and
// plans the problem: python_api/native.py, NativeVariant.
std::shared_ptr<PlanEntry> make_plan(PyObject* planner, py::tuple args, bool backward,
                                     const CuteFaShape& shape, int32_t sink) {
  TORCH_CHECK(planner != nullptr, "cute_fa native: no planner set (python_api.native.load)");
  py::object r = py::reinterpret_borrow<py::object>(planner)(*args);
  auto entry = std::make_shared<PlanEntry>();
  entry->kernels = kernel_set(state(), r.attr("kernels"), r.attr("handles"));
  entry->nvtx_name = r.attr("nvtx_name").cast<std::string>();
  const int64_t num_sms = r.attr("num_sms").cast<int64_t>();
  const auto window_sides = r.attr("window").cast<std::pair<int64_t, int64_t>>();
  const CuteFaWindow window{window_sides.first, window_sides.second};
  int status;
  if (backward) {
    const auto v = read_variant<CuteFaBwdVariant>(r.attr("variant"));
    status = cute_fa_plan_bwd(&v, &shape, &window, nullptr, sink, nullptr, num_sms,
                              &entry->plan);
  } else {
    const auto v = read_variant<CuteFaFwdVariant>(r.attr("variant"));
    status = cute_fa_plan_fwd(&v, &shape, &window, nullptr, sink, nullptr, 0, num_sms, 0, 0,
                              &entry->plan);
  }
  TORCH_CHECK(status == 0, "cute_fa native: no launch plan for this problem");
  return entry;
}

// The plan of one problem, from the cache or planned now.
std::shared_ptr<const PlanEntry> plan_for(const PlanKey& key, bool backward,
                                          const at::Tensor& like, const CuteFaShape& shape,
                                          bool sink, const std::function<py::tuple()>& args) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.plans.find(key);
    if (it != s.plans.end()) {
      s.recent.splice(s.recent.begin(), s.recent, it->second);
      return it->second->second;
    }
  }
  std::shared_ptr<PlanEntry> entry;
  {
    py::gil_scoped_acquire gil;
    entry = make_plan(backward ? s.bwd_planner : s.fwd_planner, args(), backward, shape, sink);
  }
  entry->unused_i32 = at::empty({1, 1, 1}, like.options().dtype(at::kInt));
  entry->unused_f32 = at::empty({1, 1, 1}, like.options().dtype(at::kFloat));
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.plans.find(key);
  if (it != s.plans.end()) return it->second->second;  // a racing thread's
  s.recent.emplace_front(key, entry);
  s.plans[key] = s.recent.begin();
  if (s.recent.size() > kMaxPlans) {
    s.plans.erase(s.recent.back().first);
    s.recent.pop_back();
  }
  return entry;
}

// Runs a plan: allocates its buffers like the call's first input, launches
// on torch's current stream inside the problem's NVTX range, and returns
// the output buffers.
std::vector<at::Tensor> execute(const PlanEntry& e, std::vector<at::Tensor>& buffers,
                                double softmax_scale, double softcap) {
  const CuteFaPlan& plan = e.plan;
  const at::Tensor& first = buffers[0];
  for (int32_t i = plan.num_inputs; i < plan.num_buffers; ++i) {
    const CuteFaBuffer& b = plan.buffers[i];
    const at::ScalarType dtype = b.dtype == CUTE_FA_F32   ? at::kFloat
                                 : b.dtype == CUTE_FA_I32 ? at::kInt
                                                          : first.scalar_type();
    if (b.init == CUTE_FA_UNUSED) {
      buffers.push_back(dtype == at::kInt ? e.unused_i32 : e.unused_f32);
      continue;
    }
    const at::IntArrayRef shape(b.shape, b.ndim);
    const auto options = first.options().dtype(dtype);
    buffers.push_back(b.init == CUTE_FA_ZERO ? at::zeros(shape, options)
                                             : at::empty(shape, options));
  }
  std::array<DLTensor, CUTE_FA_PLAN_MAX_BUFFERS> views;
  for (int32_t i = 0; i < plan.num_buffers; ++i) views[i] = dl_view(buffers[i]);
  {
    NvtxRange range(e.nvtx_name);
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    const int32_t device = static_cast<int32_t>(first.device().index());
    cute_fa::EnvStream stream(device, impl->getStream(first.device()).native_handle());
    TORCH_CHECK(stream.ok(), "cute_fa native: TVMFFIEnvSetStream failed");
    const std::string error =
        cute_fa::run_launches(plan, e.kernels->launches.data(), views.data(), softmax_scale,
                              softcap);
    TORCH_CHECK(error.empty(), "cute_fa native: ", error);
  }
  std::vector<at::Tensor> outputs;
  for (int32_t i = 0; i < plan.num_outputs; ++i) outputs.push_back(buffers[plan.outputs[i]]);
  return outputs;
}

CuteFaShape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return CuteFaShape{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3),
                     v.size(3)};
}

// --------------------------------------------------------------- checks

bool supported_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

bool is_kernel_head_dim(int64_t d) { return d == 64 || d == 96 || d == 128 || d == 192 || d == 256; }

// The fast acceptance of validate._attention_tensors_ok for the head dims the
// kernels have (config.SUPPORTED_HEAD_DIMS, v's no wider than q's): nothing
// that the naming checks reject.
bool attention_tensors_ok(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          std::optional<double> scale) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return false;
  if (k.size(0) != v.size(0) || k.size(1) != v.size(1) || k.size(2) != v.size(2)) return false;
  if (q.numel() == 0 || k.numel() == 0 || v.numel() == 0) return false;
  const auto dtype = q.scalar_type();
  if (!supported_dtype(dtype) || k.scalar_type() != dtype || v.scalar_type() != dtype) return false;
  const int64_t d = q.size(3), dv = v.size(3);
  if (!is_kernel_head_dim(d) || !is_kernel_head_dim(dv) || dv > d) return false;
  if (k.size(3) != d || k.size(0) != q.size(0)) return false;
  if (q.size(2) % k.size(2) != 0) return false;
  if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1) return false;
  if (q.device() != k.device() || q.device() != v.device()) return false;
  return !scale || (*scale > 0.0 && std::isfinite(*scale));
}

// A call that fails the fast check goes to the op's Python CUDA kernel
// (ops.py), which validates first: a bad call gets the error that names the
// argument (propagated to the caller as that Python exception), and a valid
// one that the C++ path does not take (head dims padded to a kernel's) runs.
template <typename Result>
Result fall_back(PyObject* fallback, const std::function<py::tuple()>& args) {
  py::gil_scoped_acquire gil;
  TORCH_CHECK(fallback != nullptr, "cute_fa native: no fallback set (python_api.ops)");
  return py::reinterpret_borrow<py::object>(fallback)(*args()).cast<Result>();
}

// `t`, or a compact copy where TMA could not read it (ops._tma_ready).
at::Tensor tma_ready(const at::Tensor& t) {
  const int64_t mask = 16 / t.element_size() - 1;
  const bool ok = (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0 &&
                  (t.stride(0) & mask) == 0 && (t.stride(1) & mask) == 0 &&
                  (t.stride(2) & mask) == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// ------------------------------------------------------------- the ops

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, std::optional<double> scale,
                                            bool causal, bool deterministic, int64_t window_left,
                                            int64_t window_right, double softcap,
                                            const std::optional<at::Tensor>& learnable_sink) {
  if (!attention_tensors_ok(q, k, v, scale) ||
      !score_args_ok(window_left, window_right, softcap, learnable_sink, q))
    return fall_back<std::tuple<at::Tensor, at::Tensor>>(state().fallback_fwd, [&] {
      return py::make_tuple(q, k, v, scale, causal, deterministic, window_left, window_right,
                            softcap, learnable_sink);
    });
  const CuteFaShape shape = shape_of(q, k, v);
  const bool sink = learnable_sink.has_value();
  const PlanKey key{q.device().index(), static_cast<int64_t>(q.scalar_type()), shape.batch,
                    shape.seqlen_q, shape.seqlen_k, shape.heads, shape.heads_kv,
                    shape.head_dim, shape.head_dim_v, causal, 0, 0, window_left, window_right,
                    softcap > 0.0, sink};
  const auto entry = plan_for(key, false, q, shape, sink, [&] {
    return py::make_tuple(q, k, v, causal, window_left, window_right, softcap, sink);
  });
  const double softmax_scale =
      scale ? *scale : 1.0 / std::sqrt(static_cast<double>(shape.head_dim));
  std::vector<at::Tensor> buffers{tma_ready(q), tma_ready(k), tma_ready(v)};
  buffers.reserve(CUTE_FA_PLAN_MAX_BUFFERS);
  if (sink) buffers.push_back(sink_input(*learnable_sink));
  auto out = execute(*entry, buffers, softmax_scale, softcap);
  return {out[0], out[1]};
}

bool backward_inputs_ok(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                        double scale, const std::optional<at::Tensor>& grad_lse) {
  if (!attention_tensors_ok(q, k, v, scale)) return false;
  // The backward kernel has every forward head dim (v's at most q's:
  // attention_tensors_ok).
  const auto dtype = q.scalar_type();
  const std::array<int64_t, 4> out_sizes{q.size(0), q.size(1), q.size(2), v.size(3)};
  for (const at::Tensor* t : {&grad_out, &out}) {
    if (t->sizes() != at::IntArrayRef(out_sizes) || t->scalar_type() != dtype ||
        t->device() != q.device() || t->stride(3) != 1)
      return false;
  }
  const std::array<int64_t, 3> stats{q.size(0), q.size(2), q.size(1)};
  auto stats_ok = [&](const at::Tensor& t) {
    return t.sizes() == at::IntArrayRef(stats) && t.scalar_type() == at::kFloat &&
           t.device() == q.device();
  };
  return stats_ok(lse) && (!grad_lse || stats_ok(*grad_lse));
}

// grad_q, grad_k, grad_v and the sinks' gradient (empty without sinks: ops.py)
using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Grads bwd_cuda(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
               const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, double scale,
               bool causal, const std::optional<at::Tensor>& grad_lse, bool deterministic,
               int64_t window_left, int64_t window_right, double softcap,
               const std::optional<at::Tensor>& learnable_sink) {
  if (!backward_inputs_ok(grad_out, q, k, v, out, lse, scale, grad_lse) ||
      !score_args_ok(window_left, window_right, softcap, learnable_sink, q))
    return fall_back<Grads>(state().fallback_bwd, [&] {
      return py::make_tuple(grad_out, q, k, v, out, lse, scale, causal, grad_lse,
                            deterministic, window_left, window_right, softcap, learnable_sink);
    });
  const CuteFaShape shape = shape_of(q, k, v);
  const bool sink = learnable_sink.has_value();
  const PlanKey key{q.device().index(), static_cast<int64_t>(q.scalar_type()), shape.batch,
                    shape.seqlen_q, shape.seqlen_k, shape.heads, shape.heads_kv,
                    shape.head_dim, shape.head_dim_v, causal, deterministic,
                    1 + grad_lse.has_value(), window_left, window_right, softcap > 0.0, sink};
  const auto entry = plan_for(key, true, q, shape, sink, [&] {
    return py::make_tuple(q, k, v, causal, deterministic, grad_lse.has_value(), window_left,
                          window_right, softcap, sink);
  });
  const at::Tensor lse_c = lse.contiguous();
  std::vector<at::Tensor> buffers{tma_ready(grad_out), tma_ready(q),   tma_ready(k),
                                  tma_ready(v),        tma_ready(out), lse_c,
                                  grad_lse ? grad_lse->to(at::kFloat).contiguous() : lse_c};
  buffers.reserve(CUTE_FA_PLAN_MAX_BUFFERS);
  if (sink) buffers.push_back(sink_input(*learnable_sink));
  auto grads = execute(*entry, buffers, scale, softcap);
  // d(sink): the preprocess's partials summed in a fixed order (ops.sink_grad)
  const std::array<int64_t, 2> batch_and_parts{0, 2};
  at::Tensor dsink = sink ? grads[3].sum(at::IntArrayRef(batch_and_parts))
                                .to(learnable_sink->scalar_type())
                          : at::empty({0}, lse.options());
  return {grads[0], grads[1], grads[2], dsink};
}

// Registered on demand (register_cuda_kernels), not at load time, so that the
// Python side decides which implementation serves the CUDA key. Never
// deregistered: the registrations must outlive the interpreter's shutdown.
void register_cuda_kernels() {
  static torch::Library* cuda_library = nullptr;
  if (cuda_library != nullptr) return;
  cuda_library = new torch::Library(torch::Library::IMPL, "cute_fa", c10::DispatchKey::CUDA,
                                    __FILE__, __LINE__);
  cuda_library->impl("fwd", TORCH_FN(fwd_cuda));
  cuda_library->impl("bwd", TORCH_FN(bwd_cuda));
}

void set_planners(py::object fwd_planner, py::object bwd_planner) {
  State& s = state();
  for (auto [slot, obj] : {std::pair{&s.fwd_planner, &fwd_planner},
                           std::pair{&s.bwd_planner, &bwd_planner}}) {
    Py_XDECREF(*slot);
    *slot = obj->inc_ref().ptr();
  }
}

void set_fallbacks(py::object fwd, py::object bwd) {
  State& s = state();
  for (auto [slot, obj] : {std::pair{&s.fallback_fwd, &fwd}, std::pair{&s.fallback_bwd, &bwd}}) {
    Py_XDECREF(*slot);
    *slot = obj->inc_ref().ptr();
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cute_fa's CUDA op kernels on the host side (see csrc/cute_fa_native.cpp)";
  m.def("set_planners", &set_planners, "the planners, from python_api.native");
  m.def("set_fallbacks", &set_fallbacks,
        "the ops' Python CUDA kernels, for valid calls the C++ path does not take (ops.py)");
  m.def("register_cuda_kernels", &register_cuda_kernels,
        "serve cute_fa::fwd and cute_fa::bwd on the CUDA key from here");
  // The defaults of the op schemas: the dispatcher leaves out trailing
  // arguments that equal them, and ops.py hands its arguments on as they came.
  m.def("fwd", &fwd_cuda, "cute_fa::fwd on CUDA tensors, without the dispatcher", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("softmax_scale") = py::none(),
        py::arg("causal") = false, py::arg("deterministic") = false,
        py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("softcap") = 0.0,
        py::arg("learnable_sink") = py::none());
  m.def("bwd", &bwd_cuda, "cute_fa::bwd on CUDA tensors, without the dispatcher",
        py::arg("grad_out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("grad_lse") = py::none(), py::arg("deterministic") = false,
        py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("softcap") = 0.0,
        py::arg("learnable_sink") = py::none());
  m.def("cached_plans", [] { return state().plans.size(); });
  m.def("plan_capacity", [] { return kMaxPlans; });
  // What a prebuilt module (CMake) was built against; native.py compares it
  // with the torch it runs under.
  m.attr("built_for_torch") = std::to_string(TORCH_VERSION_MAJOR) + "." +
                              std::to_string(TORCH_VERSION_MINOR) + "." +
                              std::to_string(TORCH_VERSION_PATCH);
}
