"""Packed (varlen) batches: the ops `torch.ops.cute_fa.varlen_fwd` and
`varlen_bwd`, their checks, and their CPU, fake and CUDA kernels.

A packed batch holds sequences of different lengths one after another:
q (total_q, nheads, d), k and v (total_k, nheads_kv, d / dv); sequence b's
queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] (int32, batch + 1
entries, from 0), its keys likewise; seqused_q / seqused_k (int32, batch),
where given, say how many of a segment's rows take part. Masks (causal, a
window) are aligned to each sequence's own lengths. The LSE is (nheads,
total_q). FlashAttention's layout and names (flash_attn_varlen_func).

max_seqlen_q / max_seqlen_k must be at least every sequence's length (the
kernels' grids and the window's bounds are sized by them; flash_attn_varlen_func
computes them when not given). The values of cu_seqlens and seqused are not
read on the host (that would wait for the GPU on every call): lengths that
run past the tensors are cut at their end by the kernels, so a wrong one
gives wrong rows, never a write outside the outputs. flash_attn_varlen_func
checks them, and the max_seqlen given against them, where it reads them
anyway (a max_seqlen not given); the CPU op always does. Rows outside every
sequence (past seqused, or past cu_seqlens[-1]) are left undefined in the
output, as FlashAttention does, and get zero gradients.
"""

from __future__ import annotations

import torch

from . import launch_plan, ops
from . import nvtx as nvtx_ranges
from .kernels.config import kernel_head_dim
from .reference import resolve_scale, varlen_attention_reference, varlen_backward_reference
from .scores import check_score_args, check_sink, resolve
from .validate import check_cuda_device, check_head_dims, check_softmax_scale, describe
from .variants import bwd_kernels_for, fwd_kernel_for, num_sms

_INDEX_NAMES = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        seqused_q=None, seqused_k=None, softmax_scale=None) -> None:
    """A clear error for any argument of a packed call the kernels cannot take."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D packed tensor (total_tokens, nheads, "
                             f"headdim), got shape {tuple(t.shape)}")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{name}: expected dtype torch.bfloat16 or torch.float16, got "
                            f"{t.dtype}")
        if t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(f"{name}: expected the last dimension (headdim) to be contiguous, "
                             f"got strides {t.stride()}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, "
                        f"v {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v: expected one device, got q {q.device}, k {k.device}, "
                         f"v {v.device}")
    head_dim = q.shape[2]
    check_head_dims(head_dim, v.shape[2])
    if k.shape[2] != head_dim:
        raise ValueError(f"k: expected headdim {head_dim} (that of q), got {k.shape[2]}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k, v: expected equal (total_k, nheads_kv), got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"k: expected nheads_kv to divide nheads_q = {q.shape[1]}, got "
                         f"{k.shape[1]}")
    for name, t in zip(_INDEX_NAMES, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)):
        if t is None and name.startswith("seqused"):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous 1-D torch.int32 tensor, got "
                             f"dtype {t.dtype}, shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (that of q), got {t.device}")
    if cu_seqlens_q.numel() < 1:
        raise ValueError("cu_seqlens_q: expected batch + 1 >= 1 entries (cumulative lengths "
                         "from 0), got none")
    if cu_seqlens_k.numel() != cu_seqlens_q.numel():
        raise ValueError(f"cu_seqlens_k: expected batch + 1 = {cu_seqlens_q.numel()} entries "
                         f"(those of cu_seqlens_q, at least 1), got {cu_seqlens_k.numel()}")
    batch = cu_seqlens_q.numel() - 1
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None and t.numel() != batch:
            raise ValueError(f"{name}: expected batch = {batch} entries, got {t.numel()}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    check_softmax_scale(softmax_scale)


def check_seqlen_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int,
                        seqused_q=None, seqused_k=None) -> tuple[int, int]:
    """Reads cu_seqlens (and seqused) on the host: starts at 0, never
    decreasing, ending inside the tensors, seqused inside each segment.
    Returns the longest (query, key) sequences."""
    longest = []
    for side, cu, used, total in (("q", cu_seqlens_q, seqused_q, total_q),
                                  ("k", cu_seqlens_k, seqused_k, total_k)):
        values = cu.tolist()
        lengths = [b - a for a, b in zip(values, values[1:])]
        if values[0] != 0 or any(n < 0 for n in lengths) or values[-1] > total:
            raise ValueError(f"cu_seqlens_{side}: expected cumulative lengths from 0, never "
                             f"decreasing, ending at most at total_{side} = {total}, got "
                             f"{values if len(values) <= 16 else values[:16] + ['...']}")
        if used is not None:
            used_values = used.tolist()
            if any(not 0 <= u <= n for u, n in zip(used_values, lengths)):
                raise ValueError(f"seqused_{side}: expected each in [0, its segment's length "
                                 f"in cu_seqlens_{side}], got {used_values[:16]}")
            lengths = used_values
        longest.append(max(lengths, default=0))
    return longest[0], longest[1]


def check_max_seqlens(longest: tuple[int, int], max_seqlen_q: int, max_seqlen_k: int) -> None:
    """max_seqlen_q / max_seqlen_k at least the longest sequences
    (check_seqlen_values'): the CUDA kernels' grids are sized by them, so
    where the lengths are read on the host anyway, one too small is an
    error rather than rows left out."""
    for side, value, needed in zip("qk", (max_seqlen_q, max_seqlen_k), longest):
        if value < needed:
            raise ValueError(f"max_seqlen_{side}: expected at least the longest sequence "
                             f"({needed}), got {value}")


def _batch_of_one(t: torch.Tensor) -> torch.Tensor:
    """A packed tensor as the kernels take it: a TMA-ready batch of one."""
    return ops.tma_ready(t.unsqueeze(0))


def _seqlen_inputs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) -> list:
    """The four int32 inputs of a packed plan, (1, 1, n) each; a seqused not
    given is bound to its cu_seqlens (the seqused bits say it is not read)."""
    return [t.view(1, 1, -1) for t in (cu_seqlens_q, cu_seqlens_k,
                                       cu_seqlens_q if seqused_q is None else seqused_q,
                                       cu_seqlens_k if seqused_k is None else seqused_k)]


def varlen_forward_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                        max_seqlen_k: int, seqused_q, seqused_k, softmax_scale: float,
                        causal: bool, window_left: int = -1, window_right: int = -1,
                        softcap: float = 0.0, learnable_sink=None, config=None):
    """The forward kernel over a packed batch, by its launch plan; `config`
    overrides the default (profiling)."""
    check_cuda_device(q.device)
    total_q, heads, head_dim = q.shape
    batch, head_dim_v = cu_seqlens_q.numel() - 1, v.shape[2]
    if total_q == 0 or batch == 0 or max_seqlen_q == 0:
        return (q.new_empty((total_q, heads, head_dim_v)),
                torch.full((heads, total_q), float("-inf"), device=q.device))
    if k.shape[0] == 0 or max_seqlen_k == 0:  # no keys: output 0, LSE -inf (or the sink)
        return (q.new_zeros((total_q, heads, head_dim_v)),
                ops.keyless_lse((heads, total_q), 0, learnable_sink, q.device))
    sink = learnable_sink is not None
    scores = resolve(causal, window_left, window_right, softcap, max_seqlen_q, max_seqlen_k,
                     varlen=True, sink=sink)
    name = nvtx_ranges.varlen_range_name("varlen_fwd", q, v, batch, max_seqlen_q, max_seqlen_k,
                                         causal, scores)
    kernel_dim, kernel_dim_v = kernel_head_dim(head_dim), kernel_head_dim(head_dim_v)
    q, k = ops.pad_head_dim(q, kernel_dim), ops.pad_head_dim(k, kernel_dim)
    v = ops.pad_head_dim(v, kernel_dim_v)
    inputs = [_batch_of_one(q), _batch_of_one(k), _batch_of_one(v)]
    # an unbounded side of the window reaches the longest sequence, not the batch
    window = tuple(max_seqlen_k if side < 0 else side for side in scores.window)
    kernel, config, device_index = fwd_kernel_for(inputs[0], inputs[2], scores.causal, config,
                                                  scores.features, window=window)
    plan = launch_plan.plan_fwd(
        config, launch_plan.varlen_shape(q, k, v, batch, max_seqlen_q, max_seqlen_k),
        num_sms(device_index), None, scores.window,
        (total_q, k.shape[0], seqused_q is not None, seqused_k is not None), sink)
    inputs += _seqlen_inputs(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    if sink:
        inputs.append(ops.sink_input(learnable_sink))
    with nvtx_ranges.op_range(name):
        out, lse = launch_plan.execute(plan, [kernel.fn], inputs, softmax_scale, scores.softcap)
    out, lse = out[0], lse[0]
    if kernel_dim_v != head_dim_v:
        out = out[..., :head_dim_v].contiguous()
    return out, lse


def varlen_backward_cuda(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q: int, max_seqlen_k: int, seqused_q, seqused_k,
                         softmax_scale: float, causal: bool, grad_lse=None,
                         deterministic: bool = False, window_left: int = -1,
                         window_right: int = -1, softcap: float = 0.0, learnable_sink=None,
                         config=None):
    """The backward kernels over a packed batch (cute_fa::varlen_bwd's
    arguments); (dq, dk, dv), with sinks (dq, dk, dv, dsink)."""
    check_cuda_device(q.device)
    batch = cu_seqlens_q.numel() - 1
    sink = learnable_sink is not None
    if (q.shape[0] == 0 or k.shape[0] == 0 or batch == 0 or max_seqlen_q == 0
            or max_seqlen_k == 0):
        grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if not sink:
            return grads
        no_rows = q.shape[0] == 0 or batch == 0 or max_seqlen_q == 0
        if no_rows or grad_lse is None:
            return (*grads, torch.zeros_like(learnable_sink))
        # no keys: each row's weight is all the sink's and D = −dLSE, so
        # d(sink) sums dLSE over the sequences' rows
        dsink = _rows_in_sequences(grad_lse, cu_seqlens_q, seqused_q).sum(-1)
        return (*grads, dsink.to(learnable_sink.dtype))
    scores = resolve(causal, window_left, window_right, softcap, max_seqlen_q, max_seqlen_k,
                     varlen=True, sink=sink)
    name = nvtx_ranges.varlen_range_name("varlen_bwd", q, v, batch, max_seqlen_q, max_seqlen_k,
                                         causal, scores)
    (grad_out, q, k, v, out), head_dims, kernel_dims = ops.pad_backward_tensors(
        grad_out, q, k, v, out)
    packed = [_batch_of_one(t) for t in (grad_out, q, k, v, out)]
    kernels, config, device_index = bwd_kernels_for(
        packed[1], packed[2], scores.causal, deterministic, grad_lse is not None, config,
        scores.features, head_dim_v=kernel_dims[2])
    plan = launch_plan.plan_bwd(
        config, launch_plan.varlen_shape(q, k, v, batch, max_seqlen_q, max_seqlen_k),
        num_sms(device_index), scores.window,
        (q.shape[0], k.shape[0], seqused_q is not None, seqused_k is not None), sink)
    lse = lse.contiguous()[None]
    grad_lse = lse if grad_lse is None else grad_lse.float().contiguous()[None]
    inputs = packed + [lse, grad_lse] + _seqlen_inputs(cu_seqlens_q, cu_seqlens_k, seqused_q,
                                                       seqused_k)
    if sink:
        inputs.append(ops.sink_input(learnable_sink))
    with nvtx_ranges.op_range(name):
        grads = launch_plan.execute(plan, kernels.launch_list, inputs, softmax_scale,
                                    scores.softcap)
    dsink = (ops.sink_grad(grads[3], learnable_sink),) if sink else ()
    return ops.unpad_grads([g[0] for g in grads[:3]], head_dims, kernel_dims) + dsink


_lib = ops._lib
_SEQ_ARGS = ("Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
             "Tensor? seqused_q=None, Tensor? seqused_k=None")
_lib.define(f"varlen_fwd(Tensor q, Tensor k, Tensor v, {_SEQ_ARGS}, float? softmax_scale=None, "
            f"bool causal=False, bool deterministic=False, {ops.SCORE_ARGS}) "
            "-> (Tensor, Tensor)")
_lib.define("varlen_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
            "Tensor? seqused_q, Tensor? seqused_k, float softmax_scale, bool causal, "
            f"Tensor? grad_lse=None, bool deterministic=False, {ops.SCORE_ARGS}) "
            "-> (Tensor, Tensor, Tensor, Tensor)")


def _check_fwd(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, scale, window_left,
               window_right, softcap, learnable_sink):
    check_varlen_inputs(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, scale)
    check_score_args(window_left, window_right, softcap)
    check_sink(learnable_sink, q.shape[1], q.device)


def _check_bwd(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, used_q, used_k, scale,
               grad_lse, window_left, window_right, softcap, learnable_sink):
    _check_fwd(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, scale, window_left,
               window_right, softcap, learnable_sink)
    out_shape = q.shape[:2] + v.shape[2:]
    for name, t in (("grad_out", grad_out), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.shape != out_shape or t.dtype != q.dtype \
                or t.device != q.device:
            raise ValueError(f"{name}: expected shape {tuple(out_shape)}, dtype {q.dtype} on "
                             f"{q.device}, got {describe(t)}")
    for name, t in (("lse", lse), ("grad_lse", grad_lse)):
        if t is None and name == "grad_lse":
            continue
        if not isinstance(t, torch.Tensor) or t.shape != (q.shape[1], q.shape[0]) \
                or t.dtype != torch.float32 or t.device != q.device:
            raise ValueError(f"{name}: expected shape {(q.shape[1], q.shape[0])}, dtype "
                             f"torch.float32 on {q.device}, got {describe(t)}")


def _rows_in_sequences(per_row: torch.Tensor, cu_seqlens_q, seqused_q) -> torch.Tensor:
    """(nheads, total_q) values with the rows outside every sequence zeroed."""
    rows = torch.arange(per_row.shape[1], device=per_row.device)
    starts, ends = cu_seqlens_q[:-1].long(), cu_seqlens_q[1:].long()
    if seqused_q is not None:
        ends = starts + seqused_q.long()
    inside = ((rows[:, None] >= starts) & (rows[:, None] < ends)).any(-1)
    return per_row.float() * inside



def _fwd_cpu(q, k, v, cu_q, cu_k, max_q, max_k, used_q=None, used_k=None, softmax_scale=None,
             causal=False, deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
             learnable_sink=None):
    _check_fwd(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, softmax_scale, window_left,
               window_right, softcap, learnable_sink)
    check_max_seqlens(check_seqlen_values(cu_q, cu_k, q.shape[0], k.shape[0], used_q, used_k),
                      max_q, max_k)
    scores = resolve(causal, window_left, window_right, softcap, max_q, max_k, varlen=True,
                     sink=learnable_sink is not None)
    with nvtx_ranges.op_range(nvtx_ranges.varlen_range_name(
            "varlen_fwd", q, v, cu_q.numel() - 1, max_q, max_k, causal, scores)):
        return varlen_attention_reference(q, k, v, cu_q, cu_k, resolve_scale(q, softmax_scale),
                                          causal, used_q, used_k,
                                          window=(window_left, window_right), softcap=softcap,
                                          sink=learnable_sink)


def _fwd_cuda(q, k, v, cu_q, cu_k, max_q, max_k, used_q=None, used_k=None, softmax_scale=None,
              causal=False, deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
              learnable_sink=None):
    _check_fwd(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, softmax_scale, window_left,
               window_right, softcap, learnable_sink)
    return varlen_forward_cuda(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k,
                               resolve_scale(q, softmax_scale), causal, window_left,
                               window_right, softcap, learnable_sink)


def _fwd_fake(q, k, v, cu_q, cu_k, max_q, max_k, used_q=None, used_k=None, softmax_scale=None,
              causal=False, deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
              learnable_sink=None):
    _check_fwd(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, softmax_scale, window_left,
               window_right, softcap, learnable_sink)
    return (q.new_empty(q.shape[:2] + v.shape[2:]),
            torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device))


def _bwd_cpu(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, used_q, used_k,
             softmax_scale, causal, grad_lse=None, deterministic=False, window_left=-1,
             window_right=-1, softcap=0.0, learnable_sink=None):
    _check_bwd(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, used_q, used_k,
               softmax_scale, grad_lse, window_left, window_right, softcap, learnable_sink)
    check_max_seqlens(check_seqlen_values(cu_q, cu_k, q.shape[0], k.shape[0], used_q, used_k),
                      max_q, max_k)
    grads = varlen_backward_reference(grad_out, q, k, v, out, lse, cu_q, cu_k, softmax_scale,
                                      causal, used_q, used_k, grad_lse,
                                      window=(window_left, window_right), softcap=softcap,
                                      sink=learnable_sink)
    return ops.op_grads(grads, q)


def _bwd_cuda(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, used_q, used_k,
              softmax_scale, causal, grad_lse=None, deterministic=False, window_left=-1,
              window_right=-1, softcap=0.0, learnable_sink=None):
    _check_bwd(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, used_q, used_k,
               softmax_scale, grad_lse, window_left, window_right, softcap, learnable_sink)
    grads = varlen_backward_cuda(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, used_q,
                                 used_k, softmax_scale, causal, grad_lse, deterministic,
                                 window_left, window_right, softcap, learnable_sink)
    return ops.op_grads(grads, q)


def _bwd_fake(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, used_q, used_k,
              softmax_scale, causal, grad_lse=None, deterministic=False, window_left=-1,
              window_right=-1, softcap=0.0, learnable_sink=None):
    _check_bwd(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, used_q, used_k,
               softmax_scale, grad_lse, window_left, window_right, softcap, learnable_sink)
    return ops.fake_grads(q, k, v, learnable_sink)


ops.register_kernels("varlen_fwd", _fwd_cpu, _fwd_cuda, _fwd_fake)
ops.register_kernels("varlen_bwd", _bwd_cpu, _bwd_cuda, _bwd_fake)


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, softmax_scale, causal, deterministic,
     *score_args, learnable_sink) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_q, used_k, learnable_sink)
    ctx.max_seqlens = (max_q, max_k)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = resolve_scale(q, softmax_scale), causal, \
        deterministic
    ctx.score_args = score_args
    ctx.num_inputs = len(inputs)
    ctx.set_materialize_grads(False)  # an unused LSE output gives grad_lse None


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k, used_q, used_k, learnable_sink = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsink = torch.ops.cute_fa.varlen_bwd(
        grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, *ctx.max_seqlens, used_q, used_k,
        ctx.softmax_scale, ctx.causal, grad_lse, ctx.deterministic, *ctx.score_args,
        learnable_sink)
    # the inputs between v and the sinks take no gradient
    return (dq, dk, dv, *[None] * (ctx.num_inputs - 4),
            dsink if learnable_sink is not None else None)


torch.library.register_autograd("cute_fa::varlen_fwd", _backward, setup_context=_setup_context,
                                lib=_lib)
