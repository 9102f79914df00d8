// The CUDA kernels of cute_fa::fwd and cute_fa::bwd, on the host side, in C++.
//
// Why: a compiled training step without a CUDA graph is paced by its host
// (profiling/RESULTS.md), and the Python kernels of the ops cost ~80 us (fwd)
// and ~155 us (bwd) of host time per call on the H100 machine, against ~55 us
// for SDPA's cuDNN forward. Here the same work (checks, per-problem plan
// lookup, TMA-ready inputs, allocation, NVTX range, TVM-FFI launches) runs
// without the interpreter.
//
// What stays in Python (python_api/native.py, ops.py): compiling the DSL
// kernels and choosing their config, called once per new problem through the
// planner callbacks and cached here; the error messages for bad input (a
// failed fast check calls the Python validator, which raises the error that
// names the argument); the fake and CPU kernels and autograd.
//
// The launches mirror ops.forward_cuda / ops.backward_cuda argument for
// argument; tests/test_native_gpu.py checks them bitwise against each other.

#include <torch/extension.h>
#include <torch/library.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlpack/dlpack.h>
#include <nvtx3/nvToolsExt.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <array>
#include <cmath>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

constexpr double kLog2E = 1.4426950408889634;  // math.log2(math.e), as in ops.py

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

TVMFFIAny any_tensor(DLTensor* t) {
  TVMFFIAny a{};
  a.type_index = kTVMFFIDLTensorPtr;
  a.v_ptr = t;
  return a;
}

TVMFFIAny any_float(double x) {
  TVMFFIAny a{};
  a.type_index = kTVMFFIFloat;
  a.v_float64 = x;
  return a;
}

TVMFFIAny any_int(int64_t x) {
  TVMFFIAny a{};
  a.type_index = kTVMFFIInt;
  a.v_int64 = x;
  return a;
}

// Calls one compiled kernel's launcher. The tensors come first, in the
// launcher's order, then the scalars.
void launch(TVMFFIObjectHandle fn, std::initializer_list<const at::Tensor*> tensors,
            std::initializer_list<TVMFFIAny> scalars) {
  std::array<DLTensor, 12> views;
  std::array<TVMFFIAny, 16> args;
  size_t n = 0;
  for (const at::Tensor* t : tensors) {
    views[n] = dl_view(*t);
    args[n] = any_tensor(&views[n]);
    ++n;
  }
  for (const TVMFFIAny& s : scalars) args[n++] = s;
  TVMFFIAny result{};
  result.type_index = kTVMFFINone;
  if (TVMFFIFunctionCall(fn, args.data(), static_cast<int32_t>(n), &result) != 0) {
    TVMFFIObjectHandle err = nullptr;
    TVMFFIErrorMoveFromRaised(&err);
    std::string message = "cute_fa native: kernel launch failed";
    if (err != nullptr) {
      // The error's cell follows its object header (c_api.h, TVMFFIErrorCell).
      const auto* cell = reinterpret_cast<const TVMFFIErrorCell*>(
          reinterpret_cast<const char*>(err) + sizeof(TVMFFIObject));
      message += ": " + std::string(cell->kind.data, cell->kind.size) + ": " +
                 std::string(cell->message.data, cell->message.size);
      TVMFFIObjectDecRef(err);
    }
    TORCH_CHECK(false, message);
  }
  if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
}

// The kernels read the stream from TVM-FFI's environment (they were compiled
// with use_tvm_ffi_env_stream); it is set to torch's current stream for the
// calls and restored after.
class EnvStream {
 public:
  explicit EnvStream(const at::Tensor& t) : device_(static_cast<int32_t>(t.device().index())) {
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    void* stream = impl->getStream(t.device()).native_handle();
    TORCH_CHECK(TVMFFIEnvSetStream(kDLCUDA, device_, stream, &previous_) == 0,
                "cute_fa native: TVMFFIEnvSetStream failed");
  }
  ~EnvStream() { TVMFFIEnvSetStream(kDLCUDA, device_, previous_, nullptr); }

 private:
  int32_t device_;
  TVMFFIStreamHandle previous_ = nullptr;
};

class NvtxRange {
 public:
  explicit NvtxRange(const std::string& name) { nvtxRangePushA(name.c_str()); }
  ~NvtxRange() { nvtxRangePop(); }
};

// ------------------------------------------------------------- the plans

// What one problem needs at launch time, built once by the Python planner.
struct Plan {
  std::vector<TVMFFIObjectHandle> kernels;  // fwd: [fn]; bwd: [pre, main, post, group_sum?]
  int64_t num_sms = 0;
  int64_t tile_m = 0;              // bwd: padded query length unit
  int64_t consumer_warpgroups = 0;  // bwd: semaphore slots per query tile
  bool split_gqa = false;
  bool deterministic = false;
  bool dynamic_tiles = false;  // the config's: a tile counter of the call's own
  // fwd: the zeroed counters (tile counter, split tiles') and the split tail's
  // fp32 workspace one call reads (ops.fwd_workspace_sizes); 0: none.
  int64_t fwd_counters = 0;
  std::array<int64_t, 3> fwd_partials{0, 0, 0};
  int64_t full_tiles = 0;  // fwd: the tail plan (cute_kernels/tail_plan.py)
  int64_t tail_parts = 1;
  std::string nvtx_name;
  at::Tensor unused_semaphore;  // stands in for the bwd semaphore outside deterministic mode
                                // and for the fwd counters where none are read
  at::Tensor unused_partials;   // and for the fwd workspace without a split tail
  PyObject* keepalive = nullptr;  // the compiled kernels; never released (see state)
};

using PlanKey = std::array<int64_t, 12>;

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 0;
    for (int64_t x : k) h = h * 1000003u ^ std::hash<int64_t>()(x);
    return h;
  }
};

struct State {
  // The autograd engine runs backward ops on its own thread: the map is
  // guarded, and never while the GIL is taken (a planner runs Python).
  std::mutex mutex;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
  PyObject* fwd_planner = nullptr;
  PyObject* bwd_planner = nullptr;
  PyObject* explain_fwd = nullptr;
  PyObject* explain_bwd = nullptr;
};

// Leaked on purpose: it holds Python objects, which must not be released
// after the interpreter has shut down.
State& state() {
  static State* s = new State();
  return *s;
}

Plan make_plan(PyObject* planner, py::tuple args) {
  TORCH_CHECK(planner != nullptr, "cute_fa native: no planner set (python_api.native.load)");
  py::tuple r = py::reinterpret_borrow<py::object>(planner)(*args);
  Plan plan;
  for (py::handle h : r[0].cast<py::tuple>())
    plan.kernels.push_back(reinterpret_cast<TVMFFIObjectHandle>(h.cast<uintptr_t>()));
  plan.num_sms = r[1].cast<int64_t>();
  plan.tile_m = r[2].cast<int64_t>();
  plan.consumer_warpgroups = r[3].cast<int64_t>();
  plan.split_gqa = r[4].cast<bool>();
  plan.deterministic = r[5].cast<bool>();
  plan.nvtx_name = r[6].cast<std::string>();
  plan.keepalive = r[7].ptr();
  Py_INCREF(plan.keepalive);
  plan.dynamic_tiles = r[8].cast<bool>();
  plan.fwd_counters = r[9].cast<int64_t>();
  py::tuple partials = r[10].cast<py::tuple>();
  for (size_t i = 0; i < 3; ++i) plan.fwd_partials[i] = partials[i].cast<int64_t>();
  plan.full_tiles = r[11].cast<int64_t>();
  plan.tail_parts = r[12].cast<int64_t>();
  return plan;
}

// The plan of one problem; a new problem asks the Python planner (which
// compiles the kernels the first time). References stay valid: the map is
// node-based and plans are never erased while in use.
const Plan& plan_for(const PlanKey& key, bool backward, const at::Device& device,
                     const std::function<py::tuple()>& args) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.plans.find(key);
    if (it != s.plans.end()) return it->second;
  }
  Plan plan;
  {
    py::gil_scoped_acquire gil;
    plan = make_plan(backward ? s.bwd_planner : s.fwd_planner, args());
  }
  plan.unused_semaphore = at::empty({1, 1, 1}, at::TensorOptions().dtype(at::kInt).device(device));
  plan.unused_partials =
      at::empty({1, 1, 1}, at::TensorOptions().dtype(at::kFloat).device(device));
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.plans.emplace(key, std::move(plan)).first->second;  // keeps a racing thread's
}

// --------------------------------------------------------------- checks

bool supported_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// The fast acceptance of validate._attention_tensors_ok: everything that it
// accepts, and nothing that the naming checks reject.
bool attention_tensors_ok(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          std::optional<double> scale) {
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || k.sizes() != v.sizes()) return false;
  if (q.numel() == 0 || k.numel() == 0) return false;
  const auto dtype = q.scalar_type();
  if (!supported_dtype(dtype) || k.scalar_type() != dtype || v.scalar_type() != dtype) return false;
  const int64_t d = q.size(3);
  if (!(d == 64 || d == 96 || d == 128) || k.size(3) != d || k.size(0) != q.size(0)) return false;
  if (q.size(2) % k.size(2) != 0) return false;
  if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1) return false;
  if (q.device() != k.device() || q.device() != v.device()) return false;
  return !scale || (*scale > 0.0 && std::isfinite(*scale));
}

void explain(PyObject* explainer, const std::function<py::tuple()>& args) {
  py::gil_scoped_acquire gil;
  TORCH_CHECK(explainer != nullptr, "cute_fa native: no validator set (python_api.native.load)");
  // Raises the error that names the argument (propagated to the caller as
  // that Python exception); returns when the fast check was only stricter.
  py::reinterpret_borrow<py::object>(explainer)(*args());
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
                                            bool causal, bool deterministic) {
  if (!attention_tensors_ok(q, k, v, scale))
    explain(state().explain_fwd, [&] { return py::make_tuple(q, k, v, scale); });
  const int64_t b = q.size(0), sq = q.size(1), h = q.size(2), d = q.size(3);
  const PlanKey key{q.device().index(), static_cast<int64_t>(q.scalar_type()), b, sq,
                    k.size(1), h, k.size(2), d, causal, 0, 0, 0};
  const Plan& plan =
      plan_for(key, false, q.device(), [&] { return py::make_tuple(q, k, causal); });
  const double softmax_scale = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(d));
  const at::Tensor qr = tma_ready(q), kr = tma_ready(k), vr = tma_ready(v);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({b, h, sq}, q.options().dtype(at::kFloat));
  // Counters and workspace shared between calls would be raced by launches
  // on other streams.
  at::Tensor counters =
      plan.fwd_counters ? at::zeros({1, 1, plan.fwd_counters}, q.options().dtype(at::kInt))
                        : plan.unused_semaphore;
  at::Tensor partials = plan.fwd_partials[0]
                            ? at::empty(plan.fwd_partials, q.options().dtype(at::kFloat))
                            : plan.unused_partials;
  NvtxRange range(plan.nvtx_name);
  EnvStream stream(q);
  launch(plan.kernels[0], {&qr, &kr, &vr, &out, &lse, &counters, &partials},
         {any_float(softmax_scale * kLog2E), any_int(plan.num_sms), any_int(plan.full_tiles),
          any_int(plan.tail_parts)});
  return {out, lse};
}

bool backward_inputs_ok(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                        double scale, const std::optional<at::Tensor>& grad_lse) {
  if (!attention_tensors_ok(q, k, v, scale)) return false;
  const auto dtype = q.scalar_type();
  for (const at::Tensor* t : {&grad_out, &out}) {
    if (t->sizes() != q.sizes() || t->scalar_type() != dtype || t->device() != q.device() ||
        t->stride(3) != 1)
      return false;
  }
  const std::array<int64_t, 3> stats{q.size(0), q.size(2), q.size(1)};
  auto stats_ok = [&](const at::Tensor& t) {
    return t.sizes() == at::IntArrayRef(stats) && t.scalar_type() == at::kFloat &&
           t.device() == q.device();
  };
  return stats_ok(lse) && (!grad_lse || stats_ok(*grad_lse));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale, bool causal,
    const std::optional<at::Tensor>& grad_lse, bool deterministic) {
  if (!backward_inputs_ok(grad_out, q, k, v, out, lse, scale, grad_lse))
    explain(state().explain_bwd,
            [&] { return py::make_tuple(grad_out, q, k, v, out, lse, scale, grad_lse); });
  const int64_t b = q.size(0), sq = q.size(1), h = q.size(2), d = q.size(3);
  const int64_t sk = k.size(1), hkv = k.size(2);
  const PlanKey key{q.device().index(), static_cast<int64_t>(q.scalar_type()), b, sq, sk, h,
                    hkv, d, causal, deterministic, grad_lse.has_value(), 1};
  const Plan& plan = plan_for(key, true, q.device(), [&] {
    return py::make_tuple(q, k, causal, deterministic, grad_lse.has_value());
  });
  const at::Tensor qr = tma_ready(q), kr = tma_ready(k), vr = tma_ready(v);
  const at::Tensor outr = tma_ready(out), dor = tma_ready(grad_out);
  const at::Tensor lse_c = lse.contiguous();
  const at::Tensor dlse = grad_lse ? grad_lse->to(at::kFloat).contiguous() : lse_c;
  const auto f32 = q.options().dtype(at::kFloat);
  const int64_t padded_q = (sq + plan.tile_m - 1) / plan.tile_m * plan.tile_m;
  at::Tensor lse2 = at::empty({b, h, padded_q}, f32);
  at::Tensor dsum = at::empty({b, h, padded_q}, f32);
  at::Tensor dq_accum = at::empty({b, h, padded_q * d}, f32);
  // With dynamic_tiles its first element is the tile counter, zeroed by the
  // preprocess: one per call, as a shared one would be raced across streams.
  at::Tensor semaphore =
      plan.deterministic
          ? at::zeros({b, h, padded_q / plan.tile_m * plan.consumer_warpgroups},
                      q.options().dtype(at::kInt))
      : plan.dynamic_tiles ? at::empty({1, 1, 1}, q.options().dtype(at::kInt))
                           : plan.unused_semaphore;
  at::Tensor grad_q = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor dk_main = dk, dv_main = dv;
  if (plan.split_gqa) {  // fp32 partials per query head, summed over each group after
    dk_main = at::empty({b, sk, h, d}, f32);
    dv_main = at::empty({b, sk, h, d}, f32);
  }
  NvtxRange range(plan.nvtx_name);
  EnvStream stream(q);
  launch(plan.kernels[0], {&outr, &dor, &lse_c, &dlse, &lse2, &dsum, &dq_accum, &semaphore},
         {});
  launch(plan.kernels[1],
         {&qr, &kr, &vr, &dor, &lse2, &dsum, &dq_accum, &dk_main, &dv_main, &semaphore},
         {any_float(scale * kLog2E), any_float(scale), any_int(plan.num_sms)});
  launch(plan.kernels[2], {&dq_accum, &grad_q}, {any_float(scale)});
  if (plan.split_gqa) launch(plan.kernels[3], {&dk_main, &dv_main, &dk, &dv}, {});
  return {grad_q, dk, dv};
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

void set_callbacks(py::object fwd_planner, py::object bwd_planner, py::object explain_fwd,
                   py::object explain_bwd) {
  State& s = state();
  for (auto [slot, obj] : {std::pair{&s.fwd_planner, &fwd_planner},
                           std::pair{&s.bwd_planner, &bwd_planner},
                           std::pair{&s.explain_fwd, &explain_fwd},
                           std::pair{&s.explain_bwd, &explain_bwd}}) {
    Py_XDECREF(*slot);
    *slot = obj->inc_ref().ptr();
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cute_fa's CUDA op kernels on the host side (see csrc/cute_fa_native.cpp)";
  m.def("set_callbacks", &set_callbacks, "planners and validators, from python_api.native");
  m.def("register_cuda_kernels", &register_cuda_kernels,
        "serve cute_fa::fwd and cute_fa::bwd on the CUDA key from here");
  // The defaults of the op schemas: the dispatcher leaves out trailing
  // arguments that equal them, and ops.py hands its arguments on as they came.
  m.def("fwd", &fwd_cuda, "cute_fa::fwd on CUDA tensors, without the dispatcher", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("softmax_scale") = py::none(),
        py::arg("causal") = false, py::arg("deterministic") = false);
  m.def("bwd", &bwd_cuda, "cute_fa::bwd on CUDA tensors, without the dispatcher",
        py::arg("grad_out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("grad_lse") = py::none(), py::arg("deterministic") = false);
  m.def("cached_plans", [] { return state().plans.size(); });
}
