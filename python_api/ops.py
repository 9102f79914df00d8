"""The torch custom ops (`torch.ops.cute_fa.*`): device kernels, fake and CPU
implementations.

`cute_fa::fwd(q, k, v, softmax_scale=None, causal=False, deterministic=False,
 window_left=-1, window_right=-1, softcap=0.0, learnable_sink=None) -> (out, lse)`
(softmax_scale None means 1/sqrt(headdim); a sliding window, a soft cap and
learnable sinks as scores.py says; inputs are validated here, once.)
- CUDA (sm_90): the CuTe DSL kernel (cute_kernels/fwd_sm90.py), launched by
  its launch plan (csrc/launch_plan.h) from C++ (csrc/cute_fa_native.cpp,
  native.py) where that builds, else from forward_cuda below;
- CPU: the reference math (reference.py), so the op runs anywhere;
- fake: shapes only, so torch.compile(fullgraph=True) traces callers.
Every real call runs inside an NVTX range named after the problem (nvtx.py).

`cute_fa::bwd(grad_out, q, k, v, out, lse, softmax_scale, causal, grad_lse=None,
 deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
 learnable_sink=None) -> (grad_q, grad_k, grad_v, grad_sink)`, the autograd
formula of `fwd`, which saves only q, k, v, out, lse (and the sinks);
grad_sink is the sinks' gradient in their dtype, or an empty fp32 tensor
for a call without sinks. `deterministic` (a forward argument, so
that autograd can hand it on) makes the gradients bitwise reproducible.
- CUDA (sm_90): preprocess, the DSL backward kernel and the dQ postprocess
  (cute_kernels/bwd_sm90.py, bwd_pre_post.py), launched as the forward's;
- CPU: the closed-form backward of reference.py; fake: shapes only.
"""

from __future__ import annotations

import torch

from . import launch_plan, native
from .kernels import tail_plan
from .kernels.config import FwdConfig, kernel_head_dim
from .kernels.bwd_config import BwdConfig
from . import nvtx as nvtx_ranges
from .reference import attention_backward_reference, attention_reference, resolve_scale
from .scores import check_score_args, check_sink, resolve
from .validate import check_attention_inputs, check_backward_inputs
from .variants import bwd_kernels_for, fwd_kernel_for, num_sms


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` (4-D), or a compact copy where TMA could not read it: TMA needs a
    16-byte aligned base and strides that are multiples of 16 bytes."""
    s = t.stride()
    mask = 16 // t.element_size() - 1
    if not ((t.data_ptr() & 15) | (s[0] & mask) | (s[1] & mask) | (s[2] & mask)):
        return t
    # A fresh allocation is 256-byte aligned and compact; .contiguous() alone
    # would hand back a misaligned tensor that is already contiguous.
    return t.clone(memory_format=torch.contiguous_format)


# The host path below runs once per attention call; a compiled training step
# without a CUDA graph is paced by its host, so it avoids what costs there:
# context managers, generators and repeated lookups (docs/findings.md, "Host path").

def forward_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                 causal: bool, config: FwdConfig | None = None,
                 tail: tail_plan.TailPlan | None = None, window_left: int = -1,
                 window_right: int = -1, softcap: float = 0.0,
                 learnable_sink: torch.Tensor | None = None,
                 block_lists: torch.Tensor | None = None):
    """Run the DSL forward kernel by its launch plan (launch_plan.py);
    `config` overrides the per-problem default (this is how profiling.sweep
    A/Bs kernel variants), `tail` the split of the last round that a
    split_tail config would choose. block_lists: a block mask's forward tile
    lists (block_sparse_ops.py; a config must have the tiles they were
    packed for)."""
    if q.numel() == 0 or k.shape[1] == 0:
        return empty_forward(q, v, learnable_sink)
    sparse = block_lists is not None
    scores = resolve(causal, window_left, window_right, softcap, q.shape[1], k.shape[1],
                     sink=learnable_sink is not None, block_sparse=sparse)
    # the caller's head dim
    name = nvtx_ranges.range_name("block_sparse_fwd" if sparse else "fwd", q, v, causal, scores)
    head_dim, head_dim_v = q.shape[3], v.shape[3]
    kernel_dim, kernel_dim_v = kernel_head_dim(head_dim), kernel_head_dim(head_dim_v)
    if kernel_dim != head_dim:  # zero columns change no score
        q, k = pad_head_dim(q, kernel_dim), pad_head_dim(k, kernel_dim)
    if kernel_dim_v != head_dim_v:  # zero columns of v give zero output columns
        v = pad_head_dim(v, kernel_dim_v)
    kernel, config, device_index = fwd_kernel_for(q, v, scores.causal, config, scores.features,
                                                  window=scores.window)
    if tail is not None:
        _check_forced_tail(config, q, tail)
    plan = launch_plan.plan_fwd(config, launch_plan.shape_of(q, k, v), num_sms(device_index),
                                tail, scores.window, sink=learnable_sink is not None,
                                block_sparse=tuple(block_lists.shape) if sparse else None)
    inputs = [tma_ready(q), tma_ready(k), tma_ready(v)]
    if learnable_sink is not None:
        inputs.append(sink_input(learnable_sink))
    if sparse:
        inputs.append(lists_input(block_lists))
    nvtx_ranges.push(name)
    try:
        out, lse = launch_plan.execute(plan, [kernel.fn], inputs, softmax_scale,
                                       scores.softcap)
    finally:
        nvtx_ranges.pop()
    if kernel_dim_v != head_dim_v:
        out = out[..., :head_dim_v].contiguous()
    return out, lse


def lists_input(block_lists: torch.Tensor) -> torch.Tensor:
    """A block mask's tile lists as the kernels read them: on a 16-byte boundary."""
    return block_lists if block_lists.data_ptr() % 16 == 0 else block_lists.clone()


def keyless_lse(shape: tuple, heads_dim: int, learnable_sink, device) -> torch.Tensor:
    """The LSE of rows that see no key, of `shape` with the heads at
    `heads_dim`: -inf, or with sinks the sink (the only column they see)."""
    if learnable_sink is None:
        return torch.full(shape, float("-inf"), device=device)
    view = [1] * len(shape)
    view[heads_dim] = -1
    return learnable_sink.float().view(view).expand(shape).contiguous()


def empty_forward(q, v, learnable_sink=None) -> tuple:
    """No query or no key: out 0 (batch, seqlen_q, heads, dv) and the keyless
    LSE (batch, heads, seqlen_q), no kernel."""
    batch, seqlen_q, heads, _ = q.shape
    out = q.new_zeros((batch, seqlen_q, heads, v.shape[3]))
    return out, keyless_lse((batch, heads, seqlen_q), 1, learnable_sink, q.device)


def empty_backward(q, k, v, grad_lse=None, learnable_sink=None) -> tuple:
    """Gradients where there is no query or no key: zero for q, k, v; a row
    with no key has all its weight on the sink and D = −dLSE, so d(sink)
    sums dLSE."""
    grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if learnable_sink is None:
        return grads
    if grad_lse is None or k.shape[1] != 0:
        return (*grads, torch.zeros_like(learnable_sink))
    return (*grads, grad_lse.float().sum(dim=(0, 2)).to(learnable_sink.dtype))


def sink_input(learnable_sink: torch.Tensor) -> torch.Tensor:
    """The sinks as the kernels read them: fp32 (1, 1, nheads)."""
    return learnable_sink.to(torch.float32).contiguous().view(1, 1, -1)


def sink_grad(partials: torch.Tensor, learnable_sink: torch.Tensor) -> torch.Tensor:
    """d(sink) from the preprocess's per-warp partials (sequences, nheads, n):
    summed in a fixed order, in the sinks' dtype."""
    return partials.sum(dim=(0, 2)).to(learnable_sink.dtype)


def pad_head_dim(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`t` with zero columns up to `head_dim` (a head dim the kernels have):
    q·k is unchanged, and v's zero columns give zero output columns."""
    if t.shape[-1] == head_dim:
        return t
    return torch.nn.functional.pad(t, (0, head_dim - t.shape[-1]))


def pad_backward_tensors(grad_out, q, k, v, out):
    """The backward's tensors at the kernels' head dims: q and k padded to
    q's kernel head dim, grad_out, v and out to v's (zero columns, whose
    gradients are zero: unpad_grads drops them). Returns (grad_out, q, k, v,
    out), the caller's head dims of q, k, v and the kernel's."""
    head_dims = (q.shape[-1], k.shape[-1], v.shape[-1])
    kernel_dim, kernel_dim_v = kernel_head_dim(q.shape[-1]), kernel_head_dim(v.shape[-1])
    kernel_dims = (kernel_dim, kernel_dim, kernel_dim_v)
    if head_dims != kernel_dims:
        q, k = pad_head_dim(q, kernel_dim), pad_head_dim(k, kernel_dim)
        grad_out, v, out = (pad_head_dim(t, kernel_dim_v) for t in (grad_out, v, out))
    return (grad_out, q, k, v, out), head_dims, kernel_dims


def unpad_grads(grads, head_dims: tuple, kernel_dims: tuple) -> tuple:
    """dq, dk, dv at the caller's head dims (pad_backward_tensors)."""
    return tuple(g[..., :d].contiguous() if d != kd else g
                 for g, d, kd in zip(grads, head_dims, kernel_dims))


def _check_forced_tail(config: FwdConfig, q: torch.Tensor, tail: tail_plan.TailPlan) -> None:
    batch, seqlen_q, heads, _ = q.shape
    num_tiles = -(-seqlen_q // config.tile_m) * heads * batch
    if tail.split:
        if (not config.split_tail or not 0 <= tail.full_tiles <= num_tiles
                or tail.parts > tail_plan.MAX_PARTS):
            raise ValueError(f"tail: expected a split of a split_tail config with full_tiles "
                             f"in [0, {num_tiles}] and parts in [2, {tail_plan.MAX_PARTS}], "
                             f"got {tail} (split_tail={config.split_tail})")
    elif tail.parts != 1:
        raise ValueError(f"tail: expected parts >= 1, got {tail}")


def backward_cuda(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, softmax_scale: float, causal: bool,
                  grad_lse: torch.Tensor | None = None, deterministic: bool = False,
                  window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                  learnable_sink: torch.Tensor | None = None, *,
                  config: BwdConfig | None = None, block_lists: torch.Tensor | None = None):
    """Run preprocess, the DSL backward kernel, the dQ postprocess (and the
    group sum of split_gqa) by their launch plan, with the arguments of
    cute_fa::bwd; `config` overrides the per-problem default
    (profiling.sweep), deterministic included; block_lists: a block mask's
    backward tile lists (as forward_cuda's). Returns (dq, dk, dv), with
    learnable sinks (dq, dk, dv, dsink)."""
    if q.numel() == 0 or k.shape[1] == 0:
        return empty_backward(q, k, v, grad_lse, learnable_sink)
    sink, sparse = learnable_sink is not None, block_lists is not None
    scores = resolve(causal, window_left, window_right, softcap, q.shape[1], k.shape[1],
                     sink=sink, block_sparse=sparse)
    # the caller's head dim
    name = nvtx_ranges.range_name("block_sparse_bwd" if sparse else "bwd", q, v, causal, scores)
    (grad_out, q, k, v, out), head_dims, kernel_dims = pad_backward_tensors(grad_out, q, k, v,
                                                                            out)
    kernels, config, device_index = bwd_kernels_for(q, k, scores.causal, deterministic,
                                                    grad_lse is not None, config, scores.features,
                                                    head_dim_v=kernel_dims[2])
    plan = launch_plan.plan_bwd(config, launch_plan.shape_of(q, k, v), num_sms(device_index),
                                scores.window, sink=sink,
                                block_sparse=tuple(block_lists.shape) if sparse else None)
    lse = lse.contiguous()
    grad_lse = lse if grad_lse is None else grad_lse.float().contiguous()
    inputs = [tma_ready(grad_out), tma_ready(q), tma_ready(k), tma_ready(v),
              tma_ready(out), lse, grad_lse]
    if sink:
        inputs.append(sink_input(learnable_sink))
    if sparse:
        inputs.append(lists_input(block_lists))
    nvtx_ranges.push(name)
    try:
        grads = launch_plan.execute(plan, kernels.launch_list, inputs, softmax_scale,
                                    scores.softcap)
    finally:
        nvtx_ranges.pop()
    if sink:
        grads = grads[:3] + (sink_grad(grads[3], learnable_sink),)
    if head_dims != kernel_dims:
        grads = unpad_grads(grads, head_dims, kernel_dims) + grads[3:]
    return grads


# The ops are defined on a torch.library.Library and their kernels registered
# straight with the dispatcher, not through torch.library.custom_op: its
# per-call wrappers cost ~28 us of host time per call (measured on this
# project's CPU machine: 34.6 vs 6.6 us for an empty op). Host time is what
# sets the pace of a compiled training step without CUDA graphs
# (docs/findings.md, "Host path"), and the compiled graph calls both ops once per layer.
_lib = torch.library.Library("cute_fa", "DEF")
SCORE_ARGS = ("int window_left=-1, int window_right=-1, float softcap=0.0, "
              "Tensor? learnable_sink=None")
_lib.define("fwd(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool causal=False, "
            f"bool deterministic=False, {SCORE_ARGS}) -> (Tensor, Tensor)")
_lib.define("bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "float softmax_scale, bool causal, Tensor? grad_lse=None, "
            f"bool deterministic=False, {SCORE_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")


def register_kernels(name: str, cpu, cuda, fake) -> None:
    """An op's CPU, CUDA (None: registered elsewhere) and fake kernels."""
    _lib.impl(name, cpu, "CPU")
    if cuda is not None:
        _lib.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"cute_fa::{name}", fake, lib=_lib)


def no_sink_grad(q: torch.Tensor) -> torch.Tensor:
    """The fourth output of a backward op called without sinks."""
    return q.new_empty((0,), dtype=torch.float32)


def op_grads(grads: tuple, q: torch.Tensor) -> tuple:
    """A backward op's four outputs from its kernel's: (dq, dk, dv) gains the
    empty sink gradient, (dq, dk, dv, dsink) stays."""
    return grads if len(grads) == 4 else (*grads, no_sink_grad(q))


def fake_grads(q, k, v, learnable_sink) -> tuple:
    """A backward op's outputs as its fake kernel gives them."""
    dsink = no_sink_grad(q) if learnable_sink is None else torch.empty_like(learnable_sink)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def _check_fwd(q, k, v, softmax_scale, window_left, window_right, softcap, learnable_sink):
    check_attention_inputs(q, k, v, softmax_scale)
    check_score_args(window_left, window_right, softcap)
    check_sink(learnable_sink, q.shape[2], q.device)


def _fwd_cpu(q, k, v, softmax_scale=None, causal=False, deterministic=False, window_left=-1,
             window_right=-1, softcap=0.0, learnable_sink=None):
    _check_fwd(q, k, v, softmax_scale, window_left, window_right, softcap, learnable_sink)
    scores = resolve(causal, window_left, window_right, softcap, q.shape[1], k.shape[1],
                     sink=learnable_sink is not None)
    with nvtx_ranges.op_range(nvtx_ranges.range_name("fwd", q, v, causal, scores)):
        out, lse = attention_reference(q, k, v, resolve_scale(q, softmax_scale), causal,
                                       window=(window_left, window_right), softcap=softcap,
                                       sink=learnable_sink)
    return out.contiguous(), lse.contiguous()


def _fwd_cuda(q, k, v, softmax_scale=None, causal=False, deterministic=False, window_left=-1,
              window_right=-1, softcap=0.0, learnable_sink=None):
    _check_fwd(q, k, v, softmax_scale, window_left, window_right, softcap, learnable_sink)
    return forward_cuda(q, k, v, resolve_scale(q, softmax_scale), causal,
                        window_left=window_left, window_right=window_right, softcap=softcap,
                        learnable_sink=learnable_sink)


def _fwd_fake(q, k, v, softmax_scale=None, causal=False, deterministic=False, window_left=-1,
              window_right=-1, softcap=0.0, learnable_sink=None):
    # Validating here makes a bad call fail while torch.compile traces, not at run time.
    _check_fwd(q, k, v, softmax_scale, window_left, window_right, softcap, learnable_sink)
    batch, seqlen_q, heads, _ = q.shape
    out = torch.empty((batch, seqlen_q, heads, v.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    return out, lse


def _check_bwd(grad_out, q, k, v, out, lse, softmax_scale, grad_lse, window_left, window_right,
               softcap, learnable_sink):
    check_backward_inputs(grad_out, q, k, v, out, lse, softmax_scale, grad_lse)
    check_score_args(window_left, window_right, softcap)
    check_sink(learnable_sink, q.shape[2], q.device)


def _bwd_cpu(grad_out, q, k, v, out, lse, softmax_scale, causal, grad_lse=None,
             deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
             learnable_sink=None):
    _check_bwd(grad_out, q, k, v, out, lse, softmax_scale, grad_lse, window_left, window_right,
               softcap, learnable_sink)
    scores = resolve(causal, window_left, window_right, softcap, q.shape[1], k.shape[1],
                     sink=learnable_sink is not None)
    with nvtx_ranges.op_range(nvtx_ranges.range_name("bwd", q, v, causal, scores)):
        grads = attention_backward_reference(grad_out, q, k, v, out, lse, softmax_scale,
                                             causal, grad_lse, window=(window_left, window_right),
                                             softcap=softcap, sink=learnable_sink)
    return op_grads(tuple(g.contiguous() for g in grads), q)


def _bwd_cuda(grad_out, q, k, v, out, lse, softmax_scale, causal, grad_lse=None,
              deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
              learnable_sink=None):
    _check_bwd(grad_out, q, k, v, out, lse, softmax_scale, grad_lse, window_left, window_right,
               softcap, learnable_sink)
    return op_grads(backward_cuda(grad_out, q, k, v, out, lse, softmax_scale, causal, grad_lse,
                                  deterministic, window_left, window_right, softcap,
                                  learnable_sink), q)


def _bwd_fake(grad_out, q, k, v, out, lse, softmax_scale, causal, grad_lse=None,
              deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
              learnable_sink=None):
    _check_bwd(grad_out, q, k, v, out, lse, softmax_scale, grad_lse, window_left, window_right,
               softcap, learnable_sink)
    return fake_grads(q, k, v, learnable_sink)


# On a CUDA machine the C++ host side of the CUDA kernels (native.py) serves
# the CUDA key where it can be built; these Python kernels otherwise.
_native = native.load() if torch.cuda.is_available() else None
if _native is not None:
    # valid calls that the C++ path does not take itself (head dims that are
    # padded to a kernel's) come back to these
    _native.set_fallbacks(_fwd_cuda, _bwd_cuda)
    _native.register_cuda_kernels()
for _name, _cpu, _cuda, _fake in (("fwd", _fwd_cpu, _fwd_cuda, _fwd_fake),
                                  ("bwd", _bwd_cpu, _bwd_cuda, _bwd_fake)):
    register_kernels(_name, _cpu, _cuda if _native is None else None, _fake)
# The eager path's kernels, with the arguments and outputs of cute_fa::fwd / cute_fa::bwd.
def _backward_outputs(*args):
    return op_grads(backward_cuda(*args), args[1])


_eager_fwd = _native.fwd if _native is not None else (
    lambda q, k, v, scale, causal, deterministic, window_left, window_right, softcap,
    learnable_sink: forward_cuda(q, k, v, scale, causal, window_left=window_left,
                                 window_right=window_right, softcap=softcap,
                                 learnable_sink=learnable_sink))
_eager_bwd = _native.bwd if _native is not None else _backward_outputs


def _save_for_backward(ctx, q, k, v, out, lse, softmax_scale: float, causal: bool,
                       deterministic: bool, score_args: tuple) -> None:
    """score_args: (window_left, window_right, softcap, learnable_sink) as the
    forward took them."""
    *scalars, learnable_sink = score_args
    ctx.save_for_backward(q, k, v, out, lse, learnable_sink)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.score_args = tuple(scalars)


def _saved_grads(ctx, grad_out, grad_lse, backward):
    """(dq, dk, dv, dsink or None) from what _save_for_backward kept;
    `backward` takes the arguments of cute_fa::bwd (the op itself, or its
    CUDA kernel)."""
    q, k, v, out, lse, learnable_sink = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsink = backward(grad_out.contiguous(), q, k, v, out, lse, ctx.softmax_scale,
                                 ctx.causal, grad_lse, ctx.deterministic, *ctx.score_args,
                                 learnable_sink)
    return dq, dk, dv, dsink if learnable_sink is not None else None


# cute_fa::fwd's Autograd kernel, registered directly rather than through
# torch.library.register_autograd: that one always redispatches, and a
# redispatch goes back through the dispatcher into Python (~10 us of host time
# per call on the CPU machine, 25-40 on the H100's host), which the compiled
# forward graph pays at every layer although it runs with grad off.
_BELOW_AUTOGRAD = torch._C._after_autograd_keyset
_FWD_BACKENDS = {torch._C.DispatchKey.CUDA: _native.fwd if _native is not None else _fwd_cuda,
                 torch._C.DispatchKey.CPU: _fwd_cpu}


def _fwd_below_autograd(keyset, *args):
    """What cute_fa::fwd runs below its Autograd kernel. Where the next key is
    the CUDA or CPU kernel (plain tensors, no dispatch mode, no
    functionalization) that kernel is exactly what a redispatch would reach,
    so it is called directly; anything else (fake and functional tensors while
    torch.compile traces, dispatch modes, subclasses) is redispatched."""
    below = keyset & _BELOW_AUTOGRAD
    kernel = _FWD_BACKENDS.get(below.highestPriorityTypeId())
    if kernel is not None:
        return kernel(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.cute_fa.fwd.default.redispatch(below, *args)


class _FwdAutograd(torch.autograd.Function):
    """The autograd formula of cute_fa::fwd: saves q, k, v, out, the LSE (and
    the sinks); the backward is cute_fa::bwd (so torch.compile traces it as
    that op)."""

    @staticmethod
    def forward(ctx, keyset, q, k, v, softmax_scale, causal, deterministic, *score_args):
        out, lse = _fwd_below_autograd(keyset, q, k, v, softmax_scale, causal, deterministic,
                                       *score_args)
        # An unused LSE output then reaches the backward as None, not as a tensor
        # of zeros that a compiled graph would fill and the preprocess would read.
        ctx.set_materialize_grads(False)
        _save_for_backward(ctx, q, k, v, out, lse, resolve_scale(q, softmax_scale), causal,
                           deterministic, score_args)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        dq, dk, dv, dsink = _saved_grads(ctx, grad_out, grad_lse, torch.ops.cute_fa.bwd)
        return None, dq, dk, dv, None, None, None, None, None, None, dsink


def _fwd_autograd(keyset, q, k, v, softmax_scale=None, causal=False, deterministic=False,
                  window_left=-1, window_right=-1, softcap=0.0, learnable_sink=None):
    # The dispatcher leaves out trailing arguments that equal their defaults.
    args = (q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap,
            learnable_sink)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
            learnable_sink is not None and learnable_sink.requires_grad)):
        return _FwdAutograd.apply(keyset, *args)
    return _fwd_below_autograd(keyset, *args)


_lib.impl("fwd", _fwd_autograd, "Autograd", with_keyset=True)


class EagerCudaAttention(torch.autograd.Function):
    """The same kernels and NVTX ranges as the ops, for eager calls on CUDA
    tensors: flash_attn_func uses it outside torch.compile. It skips what the
    ops cost in host time and an eager caller does not need: the dispatch into
    Python and a second validation forward (flash_attn_func has checked the
    inputs), and cute_fa::bwd's dispatch and checks backward (autograd hands
    back what the forward saved)."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic, window_left=-1,
                window_right=-1, softcap=0.0, learnable_sink=None):
        scale = resolve_scale(q, softmax_scale)
        score_args = (window_left, window_right, softcap, learnable_sink)
        out, lse = _eager_fwd(q, k, v, scale, causal, deterministic, *score_args)
        _save_for_backward(ctx, q, k, v, out, lse, scale, causal, deterministic, score_args)
        ctx.set_materialize_grads(False)  # an unused LSE output gives grad_lse None
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        dq, dk, dv, dsink = _saved_grads(ctx, grad_out, grad_lse, _eager_bwd)
        return dq, dk, dv, None, None, None, None, None, None, dsink
