// cute_fa_run: runs one exported attention kernel variant (python -m
// cute_fa.aot) on device buffers of a given shape and prints its time, with
// no Python in the process, e.g. for Nsight Compute:
//
//   ncu --set full ./cute_fa_run --head-dim 128 --seqlen 8192
//
// The problem is planned and launched exactly as the op does it
// (launch_plan.h, plan_launcher.h). A backward runs the matching forward
// once first, when the library has it, for realistic out and LSE.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cute_fa_kernels.h"
#include "launch_plan.h"
#include "plan_launcher.h"

namespace {

struct Options {
  bool backward = false, causal = false, deterministic = false, split_gqa = false;
  bool list = false, print_plan = false;
  std::string dtype = "bf16";
  int64_t head_dim = 128, head_dim_v = 0, seqlen = 4096, seqlen_k = 0, batch = 0, heads = 0, heads_kv = 0;
  int64_t total_tokens = 16384, iters = 20, warmup = 5, plan_sms = 132;
  double softmax_scale = 0.0;
};

const char kUsage[] =
    "usage: cute_fa_run [--bwd] [--dtype bf16|fp16] [--head-dim D] [--head-dim-v DV]\n"
    "                   [--seqlen N]\n"
    "                   [--seqlen-k N] [--batch B] [--heads H] [--heads-kv H]\n"
    "                   [--causal] [--deterministic] [--split-gqa] [--iters N]\n"
    "                   [--warmup N] [--softmax-scale S] [--list]\n"
    "                   [--plan [--plan-sms N]]\n"
    "\n"
    "Runs an exported attention kernel variant (python -m cute_fa.aot) and prints\n"
    "its time per call. Defaults: forward, bf16, head dim 128, seqlen 4096, batch\n"
    "16384 / seqlen (at least 1), 2048 / head dim query heads, as many KV heads,\n"
    "seqlen-k = seqlen, 20 timed calls after 5 warm-up calls.\n"
    "  --bwd            the backward (preprocess, main, postprocess[, group sum])\n"
    "  --deterministic  the deterministic backward;  --split-gqa  its split_gqa variant\n"
    "  --list           print the variants this build holds and exit\n"
    "  --plan           print the launch plan and exit (no GPU needed), planned\n"
    "                   for --plan-sms SMs (default 132, an H100 SXM's)\n";

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "cute_fa_run: %s\n", message.c_str());
  std::exit(2);
}

int64_t parse_int(const char* name, const char* text, int64_t min) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || value < min)
    fail(std::string(name) + ": expected an integer >= " + std::to_string(min) + ", got '" +
         text + "'");
  return value;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) fail(arg + ": expected a value");
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (arg == "--bwd") o.backward = true;
    else if (arg == "--causal") o.causal = true;
    else if (arg == "--deterministic") o.deterministic = true;
    else if (arg == "--split-gqa") o.split_gqa = true;
    else if (arg == "--list") o.list = true;
    else if (arg == "--plan") o.print_plan = true;
    else if (arg == "--dtype") {
      o.dtype = value();
      if (o.dtype != "bf16" && o.dtype != "fp16")
        fail("--dtype: expected bf16 or fp16, got '" + o.dtype + "'");
    } else if (arg == "--head-dim") {
      o.head_dim = parse_int("--head-dim", value(), 1);
    } else if (arg == "--head-dim-v") {
      o.head_dim_v = parse_int("--head-dim-v", value(), 1);
    } else if (arg == "--seqlen") o.seqlen = parse_int("--seqlen", value(), 1);
    else if (arg == "--seqlen-k") o.seqlen_k = parse_int("--seqlen-k", value(), 1);
    else if (arg == "--batch") o.batch = parse_int("--batch", value(), 1);
    else if (arg == "--heads") o.heads = parse_int("--heads", value(), 1);
    else if (arg == "--heads-kv") o.heads_kv = parse_int("--heads-kv", value(), 1);
    else if (arg == "--iters") o.iters = parse_int("--iters", value(), 1);
    else if (arg == "--warmup") o.warmup = parse_int("--warmup", value(), 0);
    else if (arg == "--plan-sms") o.plan_sms = parse_int("--plan-sms", value(), 1);
    else if (arg == "--softmax-scale") {
      const char* text = value();
      char* end = nullptr;
      o.softmax_scale = std::strtod(text, &end);
      if (end == text || *end != '\0' || !(o.softmax_scale > 0.0) ||
          !std::isfinite(o.softmax_scale))
        fail(std::string("--softmax-scale: expected a positive number, got '") + text + "'");
    } else {
      fail("unknown option '" + arg + "'\n" + kUsage);
    }
  }
  if (o.seqlen_k == 0) o.seqlen_k = o.seqlen;
  if (o.head_dim_v == 0) o.head_dim_v = o.head_dim;
  if (o.batch == 0) o.batch = std::max<int64_t>(1, o.total_tokens / o.seqlen);
  if (o.heads == 0) o.heads = std::max<int64_t>(1, 2048 / o.head_dim);
  if (o.heads_kv == 0) o.heads_kv = o.heads;
  if (o.heads % o.heads_kv != 0)
    fail("--heads-kv: expected a divisor of --heads (" + std::to_string(o.heads) + "), got " +
         std::to_string(o.heads_kv));
  if (o.softmax_scale == 0.0) o.softmax_scale = 1.0 / std::sqrt(static_cast<double>(o.head_dim));
  return o;
}

const CuteFaKernelVariant* find_variant(bool backward, const Options& o) {
  int32_t count = 0;
  const CuteFaKernelVariant* all = cute_fa_kernel_variants(&count);
  const int32_t dtype = o.dtype == "bf16" ? CUTE_FA_BF16 : CUTE_FA_FP16;
  for (int32_t i = 0; i < count; ++i) {
    const CuteFaKernelVariant& v = all[i];
    if (v.backward == backward && v.dtype == dtype && v.head_dim == o.head_dim &&
        v.head_dim_v == o.head_dim_v &&
        v.causal == o.causal && !v.lse_grad &&
        (!backward || (v.deterministic == o.deterministic && v.split_gqa == o.split_gqa)))
      return &v;
  }
  return nullptr;
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorString(status));
}

// this driver runs 16-bit variants only: their output has q's dtype
size_t element_size(int32_t dtype) {
  return dtype == CUTE_FA_INPUT_DTYPE || dtype == CUTE_FA_OUTPUT_DTYPE ? 2 : 4;
}

void print_plan(const CuteFaKernelVariant& v, const CuteFaPlan& plan) {
  std::printf("variant: %s\n", v.name);
  static const char* kDtypes[] = {"input", "f32", "i32", "output"};
  static const char* kInits[] = {"empty", "zero", "unused"};
  for (int32_t i = 0; i < plan.num_buffers; ++i) {
    const CuteFaBuffer& b = plan.buffers[i];
    std::printf("buffer %d: %s %s %s (", i, i < plan.num_inputs ? "input" : "allocated",
                kDtypes[b.dtype], kInits[b.init]);
    for (int32_t d = 0; d < b.ndim; ++d) std::printf(d ? ", %lld" : "%lld",
                                                     static_cast<long long>(b.shape[d]));
    std::printf(")\n");
  }
  for (int32_t j = 0; j < plan.num_launches; ++j) {
    const CuteFaLaunch& l = plan.launches[j];
    std::printf("launch %d: kernel %d (", j, l.kernel);
    for (int32_t a = 0; a < l.num_args; ++a) {
      const CuteFaArg& arg = l.args[a];
      if (a) std::printf(", ");
      switch (arg.kind) {
        case CUTE_FA_ARG_BUFFER: std::printf("buffer %d", arg.index); break;
        case CUTE_FA_ARG_SCALE_LOG2: std::printf("scale_log2"); break;
        case CUTE_FA_ARG_SCALE: std::printf("scale"); break;
        case CUTE_FA_ARG_PRE_TANH: std::printf("pre_tanh"); break;
        default: std::printf("%lld", static_cast<long long>(arg.value));
      }
    }
    std::printf(")\n");
  }
  std::printf("outputs:");
  for (int32_t i = 0; i < plan.num_outputs; ++i) std::printf(" %d", plan.outputs[i]);
  std::printf("\n");
}

uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // to nearest even
}

uint16_t to_fp16(float x) {  // |x| within fp16's normal range
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const float a = std::fabs(x);
  if (a < 6.103515625e-05f) return static_cast<uint16_t>(sign);
  int exponent;
  const float mantissa = std::frexp(a, &exponent);  // a = mantissa * 2^exponent, [0.5, 1)
  const uint32_t m = static_cast<uint32_t>(std::lrint((mantissa * 2.0f - 1.0f) * 1024.0f));
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exponent - 1 + 15) << 10) + m);
}

// A device buffer of the plan, with its DLTensor view (compact strides).
struct DeviceBuffer {
  void* data = nullptr;
  size_t bytes = 0;
  int64_t shape[4]{}, strides[4]{};
};

struct Problem {
  const CuteFaKernelVariant* variant;
  CuteFaPlan plan;
  std::vector<DeviceBuffer> buffers;
  std::vector<DLTensor> views;
  std::vector<TVMFFIObjectHandle> kernels;
};

Problem prepare(const CuteFaKernelVariant* v, const CuteFaShape& shape, int64_t num_sms,
                DLDataType input_dtype) {
  Problem p{v, {}, {}, {}, {}};
  // the registry's kernels have plain scores
  // (dense batches: a packed one goes through the Python path)
  const CuteFaWindow* full = &cute_fa::kNoWindow;
  const int status =
      v->backward
          ? cute_fa_plan_bwd(&v->bwd, &shape, full, nullptr, 0, nullptr, num_sms, &p.plan)
          : cute_fa_plan_fwd(&v->fwd, &shape, full, nullptr, 0, nullptr, 0, num_sms, 0, 0,
                             &p.plan);
  if (status != 0) fail(std::string("no launch plan for this shape with ") + v->name);
  p.buffers.resize(p.plan.num_buffers);
  p.views.resize(p.plan.num_buffers);
  for (int32_t i = 0; i < p.plan.num_buffers; ++i) {
    const CuteFaBuffer& b = p.plan.buffers[i];
    DeviceBuffer& d = p.buffers[i];
    int64_t elements = 1;
    for (int32_t k = b.ndim - 1; k >= 0; --k) {
      d.shape[k] = b.shape[k];
      d.strides[k] = elements;
      elements *= b.shape[k];
    }
    d.bytes = static_cast<size_t>(elements) * element_size(b.dtype);
    check(cudaMalloc(&d.data, d.bytes), "cudaMalloc");
    DLTensor& t = p.views[i];
    t.data = d.data;
    t.device = {kDLCUDA, 0};
    t.ndim = b.ndim;
    t.dtype = cute_fa::buffer_dtype(b.dtype, input_dtype);
    t.shape = d.shape;
    t.strides = d.strides;
    t.byte_offset = 0;
  }
  for (int32_t k = 0; k < v->num_launches; ++k) {
    TVMFFIObjectHandle handle = nullptr;
    if (TVMFFIFunctionCreate(nullptr, v->launches[k], nullptr, &handle) != 0)
      fail("TVMFFIFunctionCreate: " + cute_fa::take_raised_error());
    p.kernels.push_back(handle);
  }
  return p;
}

void fill_random(const DeviceBuffer& d, int32_t dtype, bool bf16, uint64_t seed) {
  const size_t n = d.bytes / element_size(dtype);
  std::vector<uint16_t> host(n);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  auto uniform = [&state] {  // (0, 1)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (static_cast<float>((state >> 40) & 0xffffff) + 0.5f) / 16777216.0f;
  };
  // Standard normal values (Box-Muller), as torch.randn gives the op's
  // callers: the tensor cores' power, and so the clocks, depend on the data.
  for (size_t i = 0; i < n; ++i) {
    const float x = std::sqrt(-2.0f * std::log(uniform())) * std::cos(6.2831853f * uniform());
    host[i] = bf16 ? to_bf16(x) : to_fp16(x);
  }
  check(cudaMemcpy(d.data, host.data(), d.bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
}

// One call: zero what the plan zeroes per call, then the launches.
void run(Problem& p, double scale, cudaStream_t stream) {
  for (int32_t i = p.plan.num_inputs; i < p.plan.num_buffers; ++i)
    if (p.plan.buffers[i].init == CUTE_FA_ZERO)
      check(cudaMemsetAsync(p.buffers[i].data, 0, p.buffers[i].bytes, stream), "cudaMemsetAsync");
  const std::string error = cute_fa::run_launches(p.plan, p.kernels.data(), p.views.data(), scale);
  if (!error.empty()) fail(error);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.list) {
    int32_t count = 0;
    const CuteFaKernelVariant* all = cute_fa_kernel_variants(&count);
    for (int32_t i = 0; i < count; ++i) std::printf("%s\n", all[i].name);
    return 0;
  }
  const CuteFaKernelVariant* variant = find_variant(o.backward, o);
  if (variant == nullptr)
    fail("this build holds no variant '" + std::string(o.backward ? "bwd " : "fwd ") + o.dtype +
         " d" + std::to_string(o.head_dim) +
         (o.head_dim_v != o.head_dim ? " dv" + std::to_string(o.head_dim_v) : "") +
         (o.causal ? " causal" : " full") +
         (o.deterministic ? " deterministic" : "") + (o.split_gqa ? " split_gqa" : "") +
         "' (--list shows those it holds; python -m cute_fa.aot exports others)");
  const CuteFaShape shape{o.batch,    o.seqlen,   o.seqlen_k, o.heads,
                          o.heads_kv, o.head_dim, o.head_dim_v};
  if (o.print_plan) {
    CuteFaPlan plan;
    const CuteFaWindow* full = &cute_fa::kNoWindow;
    const int status =
        variant->backward
            ? cute_fa_plan_bwd(&variant->bwd, &shape, full, nullptr, 0, nullptr, o.plan_sms, &plan)
            : cute_fa_plan_fwd(&variant->fwd, &shape, full, nullptr, 0, nullptr, 0, o.plan_sms,
                               0, 0, &plan);
    if (status != 0) fail(std::string("no launch plan for this shape with ") + variant->name);
    std::printf("(planned for %lld SMs)\n", static_cast<long long>(o.plan_sms));
    print_plan(*variant, plan);
    return 0;
  }

  check(cudaSetDevice(0), "cudaSetDevice");
  int num_sms = 0;
  check(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0), "device attribute");
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  cute_fa::EnvStream env_stream(0, stream);
  if (!env_stream.ok()) fail("TVMFFIEnvSetStream failed");
  const bool bf16 = o.dtype == "bf16";
  const DLDataType input_dtype = bf16 ? DLDataType{kDLBfloat, 16, 1} : DLDataType{kDLFloat, 16, 1};

  Problem problem = prepare(variant, shape, num_sms, input_dtype);
  if (!variant->backward) {
    for (int32_t i = 0; i < 3; ++i) fill_random(problem.buffers[i], CUTE_FA_INPUT_DTYPE, bf16, i);
  } else {
    // inputs: grad_out, q, k, v, out, lse, grad_lse
    for (int32_t i = 0; i < 4; ++i) fill_random(problem.buffers[i], CUTE_FA_INPUT_DTYPE, bf16, i);
    const CuteFaKernelVariant* forward = find_variant(false, o);
    if (forward != nullptr) {  // out and lse from the forward of q, k, v
      Problem fwd = prepare(forward, shape, num_sms, input_dtype);
      for (int32_t i = 0; i < 3; ++i) {
        check(cudaMemcpy(fwd.buffers[i].data, problem.buffers[i + 1].data,
                         fwd.buffers[i].bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
      }
      run(fwd, o.softmax_scale, stream);
      for (int32_t k = 0; k < 2; ++k) {
        const DeviceBuffer& from = fwd.buffers[fwd.plan.outputs[k]];
        check(cudaMemcpyAsync(problem.buffers[4 + k].data, from.data, from.bytes,
                              cudaMemcpyDeviceToDevice, stream), "cudaMemcpy");
      }
      check(cudaStreamSynchronize(stream), "the forward");
    } else {
      std::fprintf(stderr, "cute_fa_run: no forward variant to make out and LSE; random ones\n");
      fill_random(problem.buffers[4], CUTE_FA_INPUT_DTYPE, bf16, 4);
      std::vector<float> lse(problem.buffers[5].bytes / 4,
                             static_cast<float>(std::log(static_cast<double>(o.seqlen_k))));
      check(cudaMemcpy(problem.buffers[5].data, lse.data(), problem.buffers[5].bytes,
                       cudaMemcpyHostToDevice), "cudaMemcpy");
    }
    check(cudaMemset(problem.buffers[6].data, 0, problem.buffers[6].bytes), "cudaMemset");
  }

  for (int64_t i = 0; i < o.warmup; ++i) run(problem, o.softmax_scale, stream);
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  check(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int64_t i = 0; i < o.iters; ++i) run(problem, o.softmax_scale, stream);
  check(cudaEventRecord(stop, stream), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "the timed calls");
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  const double seconds = ms / 1e3 / static_cast<double>(o.iters);
  // S = Q·Kᵀ over head_dim, O = P·V over head_dim_v: 2 FLOPs per multiply-add
  double flops = 2.0 * o.batch * o.heads * static_cast<double>(o.seqlen) * o.seqlen_k *
                 static_cast<double>(o.head_dim + o.head_dim_v);
  if (o.causal) flops /= 2.0;
  if (o.backward) flops *= 2.5;
  std::printf("%s b=%lld sq=%lld sk=%lld hq=%lld hkv=%lld: %.4f ms, %.1f TFLOP/s (%lld calls)\n",
              variant->name, static_cast<long long>(o.batch), static_cast<long long>(o.seqlen),
              static_cast<long long>(o.seqlen_k), static_cast<long long>(o.heads),
              static_cast<long long>(o.heads_kv), seconds * 1e3, flops / seconds / 1e12,
              static_cast<long long>(o.iters));
  return 0;
}
