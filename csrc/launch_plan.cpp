// The launch plans of launch_plan.h.
//
// The forward's split tail (cute_kernels/tail_split.py is the kernel side):
// a tail of R tiles on P SMs costs UNSPLIT_TAIL_SHARE * n_blocks without the
// split and ceil(R * parts / P) * (n_blocks / parts + UNIT_OVERHEAD_BLOCKS)
// with it, in units of one K/V block. Both constants are fitted to forced
// plans timed on the H100 (docs/findings.md, "Split tail").

#include "launch_plan.h"

#include <cstring>
#include <initializer_list>

namespace {

// A unit's cost beyond its blocks: its first block (no softmax overlap), the
// partial's write, fence and count, and for the last part the merge.
constexpr double kUnitOverheadBlocks = 4.0;
// A last round on few SMs runs faster than a full one.
constexpr double kUnsplitTailShare = 0.85;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

double tail_cost(int64_t tail_tiles, int64_t num_sms, int64_t n_blocks, int64_t parts) {
  if (parts == 1) return kUnsplitTailShare * static_cast<double>(n_blocks);
  const int64_t rounds = ceil_div(tail_tiles * parts, num_sms);
  return static_cast<double>(rounds) *
         (static_cast<double>(n_blocks) / static_cast<double>(parts) + kUnitOverheadBlocks);
}

// Appends to a plan under construction.
class Builder {
 public:
  explicit Builder(CuteFaPlan* plan) : plan_(plan) { std::memset(plan, 0, sizeof(*plan)); }

  int input(int32_t dtype, int32_t ndim, const int64_t* shape, bool tma) {
    const int index = buffer(dtype, CUTE_FA_EMPTY, ndim, shape);
    plan_->buffers[index].tma = tma;
    plan_->num_inputs = index + 1;
    return index;
  }

  int buffer(int32_t dtype, int32_t init, int32_t ndim, const int64_t* shape) {
    if (plan_->num_buffers == CUTE_FA_PLAN_MAX_BUFFERS) { ok_ = false; return 0; }
    CuteFaBuffer& b = plan_->buffers[plan_->num_buffers];
    b.dtype = dtype;
    b.init = init;
    b.ndim = ndim;
    for (int i = 0; i < ndim; ++i) b.shape[i] = shape[i];
    return plan_->num_buffers++;
  }

  int buffer3(int32_t dtype, int32_t init, int64_t a, int64_t b, int64_t c) {
    const int64_t shape[3] = {a, b, c};
    return buffer(dtype, init, 3, shape);
  }

  int buffer4(int32_t dtype, int64_t a, int64_t b, int64_t c, int64_t d) {
    const int64_t shape[4] = {a, b, c, d};
    return buffer(dtype, CUTE_FA_EMPTY, 4, shape);
  }

  // A launch of kernel `kernel`: tensors first, in the launcher's order, then scalars.
  CuteFaLaunch* launch(int32_t kernel) {
    if (plan_->num_launches == CUTE_FA_PLAN_MAX_LAUNCHES) { ok_ = false; return &scratch_; }
    CuteFaLaunch* l = &plan_->launches[plan_->num_launches++];
    l->kernel = kernel;
    return l;
  }

  void arg(CuteFaLaunch* l, int32_t kind, int32_t index = 0, int64_t value = 0) {
    if (l->num_args == CUTE_FA_PLAN_MAX_ARGS) { ok_ = false; return; }
    l->args[l->num_args++] = CuteFaArg{kind, index, value};
  }

  void tensors(CuteFaLaunch* l, std::initializer_list<int> buffers) {
    for (int b : buffers) arg(l, CUTE_FA_ARG_BUFFER, b);
  }

  void output(int buffer) {
    if (plan_->num_outputs == CUTE_FA_PLAN_MAX_OUTPUTS) { ok_ = false; return; }
    plan_->outputs[plan_->num_outputs++] = buffer;
  }

  int status() const { return ok_ ? 0 : -1; }

 private:
  CuteFaPlan* plan_;
  CuteFaLaunch scratch_{};
  bool ok_ = true;
};

// The score arguments of a main kernel: the window as the kernels take it
// (mask.py), a side that is unbounded or wider than any row reaches becoming
// the size that reaches every key; then scale / softcap (the executor's).
void score_args(Builder& b, CuteFaLaunch* l, const CuteFaWindow* w, const CuteFaShape* s) {
  const int64_t left = (w->left < 0 || w->left > s->seqlen_k) ? s->seqlen_k : w->left;
  const int64_t right = (w->right < 0 || w->right > s->seqlen_q) ? s->seqlen_q : w->right;
  b.arg(l, CUTE_FA_ARG_INT, 0, left);
  b.arg(l, CUTE_FA_ARG_INT, 0, right);
  b.arg(l, CUTE_FA_ARG_PRE_TANH);
}

bool shape_ok(const CuteFaShape* s, const CuteFaVarlen* p) {
  return s->batch > 0 && s->seqlen_q > 0 && s->seqlen_k > 0 && s->heads > 0 &&
         s->heads_kv > 0 && s->heads % s->heads_kv == 0 && s->head_dim > 0 &&
         s->head_dim_v > 0 &&
         (p == nullptr || (p->total_q >= s->seqlen_q && p->total_k >= s->seqlen_k));
}

// The rows of q (k) as the kernels see them: dense (b, s, ...), packed (1, total, ...).
struct Rows {
  int64_t batch, q, k;
};

Rows rows_of(const CuteFaShape* s, const CuteFaVarlen* p) {
  return p ? Rows{1, p->total_q, p->total_k} : Rows{s->batch, s->seqlen_q, s->seqlen_k};
}

// The sequence-length tensors (cu_seqlens_q, cu_seqlens_k, seqused_q,
// seqused_k) the kernels take, and the seqused bits (cute_kernels/varlen.py):
// a packed batch's inputs (seqlen_inputs, right after the other inputs), or
// for a dense batch one stand-in it never reads (dense_stand_in, after the
// other buffers, so that theirs keep their places).
struct SeqlenArgs {
  int cu_q, cu_k, used_q, used_k;
  int64_t seqused;
};

void dense_stand_in(Builder& b, SeqlenArgs& a) {
  if (a.cu_q >= 0) return;
  const int unused = b.buffer3(CUTE_FA_I32, CUTE_FA_UNUSED, 1, 1, 1);
  a.cu_q = a.cu_k = a.used_q = a.used_k = unused;
}

SeqlenArgs seqlen_inputs(Builder& b, const CuteFaShape* s, const CuteFaVarlen* p) {
  if (p == nullptr) return SeqlenArgs{-1, -1, -1, -1, 0};
  const int64_t cu[3] = {1, 1, s->batch + 1};
  const int64_t used[3] = {1, 1, s->batch};
  SeqlenArgs a;
  a.cu_q = b.input(CUTE_FA_I32, 3, cu, false);
  a.cu_k = b.input(CUTE_FA_I32, 3, cu, false);
  a.used_q = b.input(CUTE_FA_I32, 3, used, false);
  a.used_k = b.input(CUTE_FA_I32, 3, used, false);
  a.seqused = (p->seqused_q ? 1 : 0) | (p->seqused_k ? 2 : 0);
  return a;
}

// The learnable sinks, fp32 (1, 1, h): an input where the call has them, or
// one stand-in the kernels never read (after the other buffers).
int sink_input(Builder& b, const CuteFaShape* s, int32_t sink) {
  if (!sink) return -1;
  const int64_t shape[3] = {1, 1, s->heads};
  return b.input(CUTE_FA_F32, 3, shape, false);
}

int f32_stand_in(Builder& b, int index) {
  return index >= 0 ? index : b.buffer3(CUTE_FA_F32, CUTE_FA_UNUSED, 1, 1, 1);
}

// The tile lists of a block mask: an input where the call has one, or one
// stand-in the kernels never read (after the other buffers).
int block_sparse_input(Builder& b, const CuteFaBlockSparse* sparse) {
  if (sparse == nullptr) return -1;
  const int64_t shape[3] = {sparse->batch, sparse->rows, sparse->words};
  return b.input(CUTE_FA_I32, 3, shape, false);
}

int i32_stand_in(Builder& b, int index) {
  return index >= 0 ? index : b.buffer3(CUTE_FA_I32, CUTE_FA_UNUSED, 1, 1, 1);
}

// The preprocess's warps per CTA and rows per CTA (cute_kernels/bwd_pre_post.py).
constexpr int64_t kPreprocessWarps = 4, kPreprocessRows = 16;

}  // namespace

extern "C" int64_t cute_fa_tail_parts(int64_t num_tiles, int64_t num_sms, int64_t n_blocks,
                                      int64_t max_parts) {
  if (num_sms <= 0) return 1;
  const int64_t tail = num_tiles % num_sms;
  if (tail == 0 || n_blocks < 2) return 1;
  int64_t best = 1;
  double best_cost = tail_cost(tail, num_sms, n_blocks, 1);
  const int64_t last = max_parts < n_blocks ? max_parts : n_blocks;
  for (int64_t parts = 2; parts <= last; ++parts) {
    const double cost = tail_cost(tail, num_sms, n_blocks, parts);
    if (cost < best_cost) {  // ties keep the fewer parts
      best_cost = cost;
      best = parts;
    }
  }
  return best;
}

extern "C" int cute_fa_plan_fwd(const CuteFaFwdVariant* v, const CuteFaShape* s,
                                const CuteFaWindow* window, const CuteFaVarlen* varlen,
                                int32_t sink, const CuteFaBlockSparse* block_sparse,
                                int32_t fp8, int64_t num_sms,
                                int64_t forced_full_tiles, int64_t forced_parts,
                                CuteFaPlan* plan) {
  if (!shape_ok(s, varlen) || v->tile_m <= 0 || v->tile_n <= 0 || num_sms <= 0) return -1;
  if (fp8 && varlen) return -1;  // the e4m3 kernels take dense batches
  // a block mask: a dense batch, tiles claimed in turn
  if (block_sparse && (varlen || fp8 || v->split_tail || forced_parts > 1)) return -1;
  // a packed batch's tiles are claimed in turn: no fixed last round to split
  if (varlen && (v->split_tail || forced_parts > 1)) return -1;
  Builder b(plan);
  const Rows r = rows_of(s, varlen);
  const int64_t bshd_q[4] = {r.batch, r.q, s->heads, s->head_dim};
  const int64_t bshd_k[4] = {r.batch, r.k, s->heads_kv, s->head_dim};
  const int64_t bshd_v[4] = {r.batch, r.k, s->heads_kv, s->head_dim_v};
  const int q = b.input(CUTE_FA_INPUT_DTYPE, 4, bshd_q, true);
  const int k = b.input(CUTE_FA_INPUT_DTYPE, 4, bshd_k, true);
  const int vv = b.input(CUTE_FA_INPUT_DTYPE, 4, bshd_v, true);
  SeqlenArgs seqs = seqlen_inputs(b, s, varlen);
  int sinks = sink_input(b, s, sink);
  int sparse = block_sparse_input(b, block_sparse);
  // e4m3: q's, k's and v's descales, each as the caller has it (no gather)
  int descales[3] = {-1, -1, -1};
  if (fp8) {
    const int64_t shape[3] = {1, s->batch, s->heads_kv};
    for (int& d : descales) d = b.input(CUTE_FA_F32, 3, shape, false);
  }

  const int64_t num_tiles = ceil_div(s->seqlen_q, v->tile_m) * s->heads * s->batch;
  int64_t full_tiles = 0, parts = 1;
  if (forced_parts > 0) {
    full_tiles = forced_full_tiles;
    parts = forced_parts;
  } else if (v->split_tail) {
    parts = cute_fa_tail_parts(num_tiles, num_sms, ceil_div(s->seqlen_k, v->tile_n),
                               v->max_parts);
    full_tiles = parts > 1 ? num_tiles - num_tiles % num_sms : 0;
  }
  if (parts > 1 && (!v->split_tail || full_tiles < 0 || full_tiles > num_tiles ||
                    parts > v->max_parts))
    return -1;
  if (parts == 1) full_tiles = 0;
  const int64_t split_tiles = parts > 1 ? num_tiles - full_tiles : 0;
  plan->full_tiles = full_tiles;
  plan->tail_parts = parts;

  const int out = b.buffer4(fp8 ? CUTE_FA_OUTPUT_DTYPE : CUTE_FA_INPUT_DTYPE, r.batch, r.q,
                            s->heads, s->head_dim_v);
  const int lse = b.buffer3(CUTE_FA_F32, CUTE_FA_EMPTY, r.batch, s->heads, r.q);
  // Fresh per call where read: shared ones would be raced by launches on other streams.
  const int counters =
      (v->dynamic_tiles || split_tiles)
          ? b.buffer3(CUTE_FA_I32, CUTE_FA_ZERO, 1, 1,
                      v->first_split_counter + split_tiles * v->consumer_warpgroups)
          : b.buffer3(CUTE_FA_I32, CUTE_FA_UNUSED, 1, 1, 1);
  const int partials =
      split_tiles ? b.buffer3(CUTE_FA_F32, CUTE_FA_EMPTY, split_tiles * parts,
                              v->partial_floats,
                              int64_t{v->threads_per_warpgroup} * v->consumer_warpgroups)
                  : b.buffer3(CUTE_FA_F32, CUTE_FA_UNUSED, 1, 1, 1);

  dense_stand_in(b, seqs);
  sinks = f32_stand_in(b, sinks);
  if (!fp8) descales[0] = descales[1] = descales[2] = f32_stand_in(b, -1);
  sparse = i32_stand_in(b, sparse);
  // the page table of a paged KV cache (python_api/decode.py's kernels only)
  const int no_pages = b.buffer3(CUTE_FA_I32, CUTE_FA_UNUSED, 1, 1, 1);
  CuteFaLaunch* fwd = b.launch(0);
  b.tensors(fwd, {q, k, vv, out, lse, counters, partials, seqs.cu_q, seqs.cu_k, seqs.used_q,
                  seqs.used_k, sinks, no_pages, descales[0], descales[1], descales[2], sparse});
  b.arg(fwd, CUTE_FA_ARG_SCALE_LOG2);
  b.arg(fwd, CUTE_FA_ARG_INT, 0, num_sms);
  b.arg(fwd, CUTE_FA_ARG_INT, 0, full_tiles);
  b.arg(fwd, CUTE_FA_ARG_INT, 0, parts);
  score_args(b, fwd, window, s);
  b.arg(fwd, CUTE_FA_ARG_INT, 0, seqs.seqused);
  b.output(out);
  b.output(lse);
  return b.status();
}

extern "C" int cute_fa_plan_bwd(const CuteFaBwdVariant* v, const CuteFaShape* s,
                                const CuteFaWindow* window, const CuteFaVarlen* varlen,
                                int32_t sink, const CuteFaBlockSparse* block_sparse,
                                int64_t num_sms, CuteFaPlan* plan) {
  // The backward kernels take v's head dim (v, the output, dO, dV) at most
  // q's; a packed batch's dK and dV leave per KV head (no split_gqa partials).
  if (!shape_ok(s, varlen) || s->head_dim_v > s->head_dim || v->tile_m <= 0 ||
      num_sms <= 0 || (varlen && v->split_gqa) ||
      (block_sparse && (varlen || v->deterministic)) ||
      (v->convert_dq && (block_sparse || sink)))
    return -1;
  Builder b(plan);
  plan->tail_parts = 1;
  const Rows r = rows_of(s, varlen);
  // B, SQ, SK: the dimensions of the tensors (a packed batch: 1, total_q, total_k)
  const int64_t B = r.batch, SQ = r.q, SK = r.k, H = s->heads, HKV = s->heads_kv,
                D = s->head_dim, DV = s->head_dim_v;
  const int64_t bshd_q[4] = {B, SQ, H, D};
  const int64_t bshd_o[4] = {B, SQ, H, DV};
  const int64_t bshd_k[4] = {B, SK, HKV, D};
  const int64_t bshd_v[4] = {B, SK, HKV, DV};
  const int64_t rows[3] = {B, H, SQ};
  const int grad_out = b.input(CUTE_FA_INPUT_DTYPE, 4, bshd_o, true);
  const int q = b.input(CUTE_FA_INPUT_DTYPE, 4, bshd_q, true);
  const int k = b.input(CUTE_FA_INPUT_DTYPE, 4, bshd_k, true);
  const int vv = b.input(CUTE_FA_INPUT_DTYPE, 4, bshd_v, true);
  const int out = b.input(CUTE_FA_INPUT_DTYPE, 4, bshd_o, true);
  const int lse = b.input(CUTE_FA_F32, 3, rows, false);
  const int grad_lse = b.input(CUTE_FA_F32, 3, rows, false);
  SeqlenArgs seqs = seqlen_inputs(b, s, varlen);
  int sinks = sink_input(b, s, sink);
  int sparse = block_sparse_input(b, block_sparse);

  // whole query tiles per sequence (a packed batch's: cute_kernels/varlen.py)
  const int64_t padded_q = ceil_div(varlen ? SQ + s->batch * v->tile_m : SQ, v->tile_m) *
                           v->tile_m;
  const int lse2 = b.buffer3(CUTE_FA_F32, CUTE_FA_EMPTY, B, H, padded_q);
  const int dsum = b.buffer3(CUTE_FA_F32, CUTE_FA_EMPTY, B, H, padded_q);
  const int dq_accum = b.buffer3(CUTE_FA_F32, CUTE_FA_EMPTY, B, H, padded_q * D);
  // Deterministic: a semaphore per query tile and dQ warpgroup. With
  // dynamic_tiles its first element is the tile counter, zeroed by the
  // preprocess; with convert_dq (a count of adds) or dq_first_store (the
  // first touch's state) a slot per query tile follows it
  // (cute_kernels/dq_accum.py), zeroed by the preprocess too. One per
  // call, as a shared one would be raced across streams.
  const int semaphore =
      v->deterministic
          ? b.buffer3(CUTE_FA_I32, CUTE_FA_ZERO, B, H,
                      padded_q / v->tile_m * v->dq_warpgroups)
      : v->convert_dq || v->dq_first_store
          ? b.buffer3(CUTE_FA_I32, CUTE_FA_EMPTY, B, H, 1 + padded_q / v->tile_m)
      : v->dynamic_tiles ? b.buffer3(CUTE_FA_I32, CUTE_FA_EMPTY, 1, 1, 1)
                         : b.buffer3(CUTE_FA_I32, CUTE_FA_UNUSED, 1, 1, 1);
  const int grad_q = b.buffer(CUTE_FA_INPUT_DTYPE, CUTE_FA_EMPTY, 4, bshd_q);
  const int grad_k = b.buffer(CUTE_FA_INPUT_DTYPE, CUTE_FA_EMPTY, 4, bshd_k);
  const int grad_v = b.buffer(CUTE_FA_INPUT_DTYPE, CUTE_FA_EMPTY, 4, bshd_v);
  int dk_main = grad_k, dv_main = grad_v;
  if (v->split_gqa) {
    dk_main = b.buffer4(CUTE_FA_F32, B, SK, H, D);
    dv_main = b.buffer4(CUTE_FA_F32, B, SK, H, DV);
  }

  // one partial of d(sink) per preprocess warp, each written once
  const int sink_partials =
      sink ? b.buffer3(CUTE_FA_F32, CUTE_FA_EMPTY, s->batch, H,
                       ceil_div(ceil_div(s->seqlen_q, v->tile_m) * v->tile_m, kPreprocessRows) *
                           kPreprocessWarps)
           : -1;

  dense_stand_in(b, seqs);
  sinks = f32_stand_in(b, sinks);
  sparse = i32_stand_in(b, sparse);
  CuteFaLaunch* pre = b.launch(0);
  b.tensors(pre, {out, grad_out, lse, grad_lse, lse2, dsum, dq_accum, grad_q, semaphore,
                  seqs.cu_q, seqs.used_q, sinks, sink_partials >= 0 ? sink_partials : sinks});
  b.arg(pre, CUTE_FA_ARG_INT, 0, seqs.seqused);
  b.arg(pre, CUTE_FA_ARG_INT, 0, s->seqlen_q);
  CuteFaLaunch* main = b.launch(1);
  b.tensors(main, {q, k, vv, grad_out, lse2, dsum, dq_accum, grad_q, dk_main, dv_main, semaphore,
                   seqs.cu_q, seqs.cu_k, seqs.used_q, seqs.used_k, sparse});
  b.arg(main, CUTE_FA_ARG_SCALE_LOG2);
  b.arg(main, CUTE_FA_ARG_SCALE);
  b.arg(main, CUTE_FA_ARG_INT, 0, num_sms);
  score_args(b, main, window, s);
  b.arg(main, CUTE_FA_ARG_INT, 0, seqs.seqused);
  // the kernels after main: their index in the variant's list
  int next_kernel = 2;
  if (!v->convert_dq) {
    CuteFaLaunch* post = b.launch(next_kernel++);
    b.tensors(post, {dq_accum, grad_q, semaphore, seqs.cu_q, seqs.used_q});
    b.arg(post, CUTE_FA_ARG_SCALE);
    b.arg(post, CUTE_FA_ARG_INT, 0, seqs.seqused);
    b.arg(post, CUTE_FA_ARG_INT, 0, s->seqlen_q);
  }
  if (v->split_gqa) {
    CuteFaLaunch* group_sum = b.launch(next_kernel);
    b.tensors(group_sum, {dk_main, dv_main, grad_k, grad_v});
  }
  if (varlen) {
    // a packed batch's rows outside every sequence get zero gradients; each
    // gap (one per sequence and the tail) spread over about a wave of CTAs
    CuteFaLaunch* row_gaps = b.launch(next_kernel);  // no group sum in a packed batch
    b.tensors(row_gaps, {grad_q, grad_k, grad_v, seqs.cu_q, seqs.cu_k, seqs.used_q,
                         seqs.used_k});
    b.arg(row_gaps, CUTE_FA_ARG_INT, 0, seqs.seqused);
    b.arg(row_gaps, CUTE_FA_ARG_INT, 0, ceil_div(num_sms, s->batch + 1));
  }
  b.output(grad_q);
  b.output(grad_k);
  b.output(grad_v);
  if (sink_partials >= 0) b.output(sink_partials);
  return b.status();
}

extern "C" void cute_fa_plan_layout(int64_t* version, int64_t* sizes, int32_t num_sizes) {
  *version = CUTE_FA_PLAN_LAYOUT_VERSION;
  const int64_t all[] = {sizeof(CuteFaShape), sizeof(CuteFaFwdVariant), sizeof(CuteFaBwdVariant),
                         sizeof(CuteFaBuffer), sizeof(CuteFaArg), sizeof(CuteFaLaunch),
                         sizeof(CuteFaPlan), sizeof(CuteFaWindow), sizeof(CuteFaVarlen),
                         sizeof(CuteFaBlockSparse)};
  for (int32_t i = 0; i < num_sizes && i < static_cast<int32_t>(sizeof(all) / sizeof(all[0]));
       ++i)
    sizes[i] = all[i];
}
