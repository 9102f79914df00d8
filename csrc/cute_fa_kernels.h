/* The kernel variants exported ahead of time (python -m cute_fa.aot), as
 * the library cute_fa_kernels (CMakeLists.txt) lists them: for each, what it
 * is, the numbers its launch plans need (launch_plan.h) and the TVM-FFI entry
 * points of its launches, in the plans' kernel order.
 *
 * To launch one: plan the problem (cute_fa_plan_fwd / cute_fa_plan_bwd with
 * the variant's numbers), allocate the plan's buffers, wrap each entry point
 * with TVMFFIFunctionCreate, set the stream with TVMFFIEnvSetStream and run
 * the launches (plan_launcher.h does that last step; cute_fa_run.cpp all of it).
 */
#ifndef CUTE_FA_KERNELS_H_
#define CUTE_FA_KERNELS_H_

#include <stdint.h>
#include <tvm/ffi/c_api.h>

#include "launch_plan.h"

#ifdef __cplusplus
extern "C" {
#endif

enum CuteFaKernelDtype { CUTE_FA_BF16 = 0, CUTE_FA_FP16 = 1 };

typedef struct {
  const char* name; /* "fwd bf16 d128 causal", "fwd bf16 d192 dv128 full",
                       "bwd fp16 d64 full deterministic", ... */
  int32_t backward; /* 0: a forward (fwd is its plan's variant), 1: a backward (bwd) */
  int32_t dtype;    /* CuteFaKernelDtype of q, k, v and the outputs */
  int32_t head_dim, head_dim_v, causal, deterministic, split_gqa, lse_grad;
  CuteFaFwdVariant fwd;
  CuteFaBwdVariant bwd;
  int32_t num_launches;
  TVMFFISafeCallType launches[CUTE_FA_PLAN_MAX_LAUNCHES];
} CuteFaKernelVariant;

/* The exported variants; *count receives their number. */
const CuteFaKernelVariant* cute_fa_kernel_variants(int32_t* count);

#ifdef __cplusplus
}
#endif

#endif /* CUTE_FA_KERNELS_H_ */
