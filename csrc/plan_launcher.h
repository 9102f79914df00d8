// Running a launch plan's kernel launches (launch_plan.h) through TVM-FFI:
// the one launcher of the C++ executors (the op's host layer,
// cute_fa_native.cpp, and the stand-alone driver, cute_fa_run.cpp). They
// allocate the plan's buffers their own way and hand this their DLTensor views.
#ifndef CUTE_FA_PLAN_LAUNCHER_H_
#define CUTE_FA_PLAN_LAUNCHER_H_

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <array>
#include <string>

#include "launch_plan.h"

namespace cute_fa {

constexpr double kLog2E = 1.4426950408889634;  // log2(e)
// The plans of kernels with plain scores (full or causal): no window.
constexpr CuteFaWindow kNoWindow{-1, -1};

// The DLPack type of a plan buffer's dtype; `input` is that of the call's q.
inline DLDataType buffer_dtype(int32_t dtype, DLDataType input) {
  switch (dtype) {
    case CUTE_FA_F32: return {kDLFloat, 32, 1};
    case CUTE_FA_I32: return {kDLInt, 32, 1};
    default: return input;
  }
}

// The raised TVM-FFI error as text (its cell follows its object header,
// c_api.h's TVMFFIErrorCell).
inline std::string take_raised_error() {
  TVMFFIObjectHandle err = nullptr;
  TVMFFIErrorMoveFromRaised(&err);
  if (err == nullptr) return "unknown error";
  const auto* cell = reinterpret_cast<const TVMFFIErrorCell*>(
      reinterpret_cast<const char*>(err) + sizeof(TVMFFIObject));
  std::string message = std::string(cell->kind.data, cell->kind.size) + ": " +
                        std::string(cell->message.data, cell->message.size);
  TVMFFIObjectDecRef(err);
  return message;
}

// Makes the plan's launches in order: kernels[launch.kernel] with the buffers'
// views and the scalars the plan names, from softmax_scale and softcap (0:
// none; launch_plan.h's arg kinds). Returns "" or what failed.
inline std::string run_launches(const CuteFaPlan& plan, const TVMFFIObjectHandle* kernels,
                                DLTensor* views, double softmax_scale, double softcap = 0.0) {
  for (int32_t j = 0; j < plan.num_launches; ++j) {
    const CuteFaLaunch& launch = plan.launches[j];
    std::array<TVMFFIAny, CUTE_FA_PLAN_MAX_ARGS> args{};
    for (int32_t i = 0; i < launch.num_args; ++i) {
      const CuteFaArg& a = launch.args[i];
      TVMFFIAny& any = args[i];
      switch (a.kind) {
        case CUTE_FA_ARG_BUFFER:
          any.type_index = kTVMFFIDLTensorPtr;
          any.v_ptr = &views[a.index];
          break;
        case CUTE_FA_ARG_SCALE_LOG2:
          any.type_index = kTVMFFIFloat;
          any.v_float64 = (softcap > 0.0 ? softcap : softmax_scale) * kLog2E;
          break;
        case CUTE_FA_ARG_PRE_TANH:
          any.type_index = kTVMFFIFloat;
          any.v_float64 = softcap > 0.0 ? softmax_scale / softcap : 0.0;
          break;
        case CUTE_FA_ARG_SCALE:
          any.type_index = kTVMFFIFloat;
          any.v_float64 = softmax_scale;
          break;
        default:
          any.type_index = kTVMFFIInt;
          any.v_int64 = a.value;
      }
    }
    TVMFFIAny result{};
    result.type_index = kTVMFFINone;
    if (TVMFFIFunctionCall(kernels[launch.kernel], args.data(), launch.num_args, &result) != 0)
      return "launch " + std::to_string(j) + " (kernel " + std::to_string(launch.kernel) +
             ") failed: " + take_raised_error();
    if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
  }
  return "";
}

// Sets TVM-FFI's stream for a device (the kernels were compiled to read it
// from there) and restores the previous one on scope exit.
class EnvStream {
 public:
  EnvStream(int32_t device, void* stream) : device_(device) {
    ok_ = TVMFFIEnvSetStream(kDLCUDA, device_, stream, &previous_) == 0;
  }
  ~EnvStream() {
    if (ok_) TVMFFIEnvSetStream(kDLCUDA, device_, previous_, nullptr);
  }
  bool ok() const { return ok_; }

 private:
  int32_t device_;
  TVMFFIStreamHandle previous_ = nullptr;
  bool ok_ = false;
};

}  // namespace cute_fa

#endif  // CUTE_FA_PLAN_LAUNCHER_H_
