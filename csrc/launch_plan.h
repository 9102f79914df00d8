/* The launch plan of one attention problem: which buffers a call allocates
 * and which kernel launches it makes with which arguments, in order.
 *
 * This is the single description of how the ops' kernels are launched. Three
 * executors run it unchanged: the op's C++ host layer (cute_fa_native.cpp),
 * the op's Python host path (python_api/launch_plan.py, through this file's
 * C functions) and the stand-alone driver (cute_fa_run.cpp). A new kernel
 * variant adds its plan here and nothing to the executors.
 *
 * The inputs are what the kernel variant is (a few numbers from its config,
 * filled by python_api/launch_plan.py or by the ahead-of-time registry that
 * the same module generates) and the problem's shape. Plain C, so that
 * Python's ctypes reads the structs as they are; the layout version below
 * changes with any of them.
 */
#ifndef CUTE_FA_LAUNCH_PLAN_H_
#define CUTE_FA_LAUNCH_PLAN_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CUTE_FA_PLAN_LAYOUT_VERSION 10
#define CUTE_FA_PLAN_MAX_BUFFERS 24
#define CUTE_FA_PLAN_MAX_ARGS 32
#define CUTE_FA_PLAN_MAX_LAUNCHES 4
#define CUTE_FA_PLAN_MAX_OUTPUTS 4

/* head_dim: that of q and k; head_dim_v: that of v and the output. A
 * packed (varlen) batch: batch sequences, seqlen_q and seqlen_k their
 * longest (CuteFaVarlen holds the totals). */
typedef struct {
  int64_t batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v;
} CuteFaShape;

/* A packed batch: sequences of different lengths one after another on a
 * token axis of total_q (total_k) rows, found through cu_seqlens; seqused_q
 * (_k): the lengths come from seqused tensors instead. NULL in the plan
 * functions: a dense batch. The kernels' side: cute_kernels/varlen.py. */
typedef struct {
  int64_t total_q, total_k;
  int32_t seqused_q, seqused_k;
} CuteFaVarlen;

/* A block-sparse call's tile lists, int32 (batch, heads * tiles, words):
 * batch and heads 1 where the mask is the same for every batch or head, one
 * row of `words` per (batch, head, outer tile) of the kernel (a query tile
 * of the forward, a key tile of the backward). NULL in the plan functions:
 * no block mask. The kernels' side: cute_kernels/block_sparse.py. */
typedef struct {
  int64_t batch, rows, words;
} CuteFaBlockSparse;

/* A sliding window around each query's (bottom-right aligned) diagonal, in
 * keys; -1: unbounded on that side. Read by local kernels only; the plan
 * hands them the sizes clamped to the shape (launch_plan.cpp). */
typedef struct {
  int64_t left, right;
} CuteFaWindow;

/* What the planner needs to know of a forward kernel variant. */
typedef struct {
  int32_t tile_m, tile_n;
  int32_t consumer_warpgroups, threads_per_warpgroup;
  int32_t dynamic_tiles;  /* a tile counter of the call's own */
  int32_t split_tail;     /* the last round of tiles may be split into key ranges */
  int32_t max_parts;      /* the most key ranges the kernel's merge holds */
  int32_t partial_floats; /* fp32 values one consumer thread leaves per part */
  int32_t first_split_counter; /* counters[0] is the tile counter */
} CuteFaFwdVariant;

/* ... and of a backward variant (preprocess, main, postprocess unless
 * convert_dq, group sum). */
typedef struct {
  int32_t tile_m, dq_warpgroups; /* the warpgroups adding a dQ share */
  int32_t dynamic_tiles, deterministic;
  int32_t split_gqa; /* fp32 dK/dV per query head, summed per group after */
  int32_t convert_dq; /* the main kernel writes dQ: no postprocess */
  int32_t dq_first_store; /* a query tile's first dQ partial stored: its state in the semaphore */
} CuteFaBwdVariant;

/* INPUT_DTYPE: that of q; OUTPUT_DTYPE: the output's where it differs from
 * q's (e4m3 inputs: bf16 or fp16, the caller's choice). */
enum CuteFaDtype {
  CUTE_FA_INPUT_DTYPE = 0,
  CUTE_FA_F32 = 1,
  CUTE_FA_I32 = 2,
  CUTE_FA_OUTPUT_DTYPE = 3
};

enum CuteFaInit {
  CUTE_FA_EMPTY = 0,   /* written before it is read */
  CUTE_FA_ZERO = 1,    /* zeroed per call (counters, semaphores) */
  CUTE_FA_UNUSED = 2,  /* never read by this variant: one tiny tensor may stand in */
};

/* Buffers 0 .. num_inputs-1 are the call's inputs (see the plan functions),
 * bound by the executor; the others it allocates, compact, per call. */
typedef struct {
  int32_t dtype, init, ndim, tma; /* tma (inputs): needs TMA-ready strides */
  int64_t shape[4];
} CuteFaBuffer;

/* The scalars of kinds SCALE_LOG2, SCALE and PRE_TANH come from the
 * executor's softmax_scale and softcap (0: none), plan_launcher.h. */
enum CuteFaArgKind {
  CUTE_FA_ARG_BUFFER = 0,     /* buffers[index] */
  CUTE_FA_ARG_SCALE_LOG2 = 1, /* the softmax's exponent factor, fp32: softmax_scale *
                                 log2(e), or with a softcap softcap * log2(e) */
  CUTE_FA_ARG_SCALE = 2,      /* softmax_scale, fp32 */
  CUTE_FA_ARG_INT = 3,        /* value, int32 */
  CUTE_FA_ARG_PRE_TANH = 4,   /* softmax_scale / softcap, fp32 (0 without a softcap) */
};

typedef struct {
  int32_t kind, index;
  int64_t value;
} CuteFaArg;

typedef struct {
  int32_t kernel; /* index into the variant's launches, in their order */
  int32_t num_args;
  CuteFaArg args[CUTE_FA_PLAN_MAX_ARGS];
} CuteFaLaunch;

typedef struct {
  int32_t num_inputs, num_buffers, num_launches, num_outputs;
  CuteFaBuffer buffers[CUTE_FA_PLAN_MAX_BUFFERS];
  CuteFaLaunch launches[CUTE_FA_PLAN_MAX_LAUNCHES];
  int32_t outputs[CUTE_FA_PLAN_MAX_OUTPUTS];
  /* forward: the split of the last round (full_tiles whole, then `tail_parts`
   * key ranges per tile; tail_parts 1: no split) */
  int64_t full_tiles, tail_parts;
} CuteFaPlan;

/* Forward. Inputs: q, k, v (dense (b, s, h, d); packed (1, total, h, d),
 * then cu_seqlens_q, cu_seqlens_k (1, 1, b + 1) and seqused_q, seqused_k
 * (1, 1, b), int32, those not in use bound to any int32 tensor); sink != 0:
 * then the learnable sinks, fp32 (1, 1, h); block_sparse: then the tile
 * lists (CuteFaBlockSparse); fp8 != 0 (e4m3 q, k, v, a dense
 * batch): then q's, k's and v's descales, fp32 (1, b, h_kv) each, any
 * strides, and out is OUTPUT_DTYPE.
 * Launches: fwd. Outputs: out, lse ((b, h, s_q); packed (1, h, total_q)).
 * forced_parts 0: the split of the tail from the cost model (launch_plan.cpp);
 * otherwise forced_full_tiles / forced_parts (a sweep's A/B, checked by the
 * caller). Returns 0, or -1 for a shape or variant it cannot plan. */
int cute_fa_plan_fwd(const CuteFaFwdVariant* variant, const CuteFaShape* shape,
                     const CuteFaWindow* window, const CuteFaVarlen* varlen, int32_t sink,
                     const CuteFaBlockSparse* block_sparse, int32_t fp8, int64_t num_sms, int64_t forced_full_tiles,
                     int64_t forced_parts, CuteFaPlan* plan);

/* Backward. Inputs: grad_out, q, k, v, out, lse, grad_lse (lse itself where
 * the call has none); packed: then the forward's four int32 tensors; sink:
 * then the sinks; block_sparse: then the backward's tile lists. Launches: preprocess, main,
 * postprocess (unless convert_dq), then group_sum (split_gqa) or row_gaps (packed: zeroes the
 * gradients' rows outside every sequence).
 * Outputs: grad_q, grad_k, grad_v; sink: then the sink gradient's partials,
 * fp32 (b, h, n), whose sum over b and n is d(sink) (the preprocess,
 * cute_kernels/bwd_pre_post.py). */
int cute_fa_plan_bwd(const CuteFaBwdVariant* variant, const CuteFaShape* shape,
                     const CuteFaWindow* window, const CuteFaVarlen* varlen, int32_t sink,
                     const CuteFaBlockSparse* block_sparse, int64_t num_sms, CuteFaPlan* plan);

/* The key ranges per tile of the forward's split tail for `num_tiles` tiles of
 * `n_blocks` K/V blocks on `num_sms` persistent CTAs (1: no split). */
int64_t cute_fa_tail_parts(int64_t num_tiles, int64_t num_sms, int64_t n_blocks,
                           int64_t max_parts);

/* CUTE_FA_PLAN_LAYOUT_VERSION and the sizes of the structs, for a caller that
 * mirrors them (Python's ctypes) to check it reads the same layout. */
void cute_fa_plan_layout(int64_t* version, int64_t* sizes, int32_t num_sizes);

#ifdef __cplusplus
}
#endif

#endif /* CUTE_FA_LAUNCH_PLAN_H_ */
