"""Block-sparse attention: the ops `torch.ops.cute_fa.block_sparse_fwd` and
`block_sparse_bwd`, their checks, and their CPU, fake and CUDA kernels.

`cute_fa::block_sparse_fwd(q, k, v, fwd_lists, bwd_lists, softmax_scale=None,
 softcap=0.0, learnable_sink=None) -> (out, lse)`: attention of dense
(batch, seqlen, nheads, d) q, k, v under a block mask, given as the tile
lists that block_mask.BlockSparseMask packs for the kernels' tiles at q's
and v's kernel head dims (`lists_for`): fwd_lists for the forward, bwd_lists
for the backward (the op saves them for it). The mask holds every limit, so
there is no causal flag or window; softcap and learnable sinks combine with
it. A row that sees no key gives 0 and LSE -inf (or the sink).
`cute_fa::block_sparse_bwd(grad_out, q, k, v, out, lse, fwd_lists, bwd_lists,
 softmax_scale, grad_lse=None, softcap=0.0, learnable_sink=None)`: its
gradients (dq, dk, dv, dsink), as cute_fa::bwd's. Not deterministic: the
key tiles' dQ partials add in whatever order they finish.
The lists' shapes are checked here; their values are not read on the host
(that would wait for the GPU): the kernels clamp counts and indices to the
lists and the tiles, so lists made otherwise than by lists_for give wrong
values, never an access outside the tensors.
- CUDA (sm_90): the forward and backward kernels with Features.block_sparse,
  launched by ops.forward_cuda / backward_cuda with the lists (block_lists);
- CPU: the reference math on the mask the lists describe;
- fake: shapes only (torch.compile(fullgraph=True)).
"""

from __future__ import annotations

import torch

from . import ops
from . import nvtx as nvtx_ranges
from .block_mask import BlockSparseMask, lists_dense
from .kernels.config import kernel_head_dim
from .kernels.bwd_config import block_sparse_tiles
from .reference import attention_backward_reference, attention_reference, resolve_scale
from .scores import check_score_args, check_sink, resolve
from .validate import check_attention_inputs, check_backward_inputs, describe


def lists_for(mask: BlockSparseMask, q: torch.Tensor, v: torch.Tensor) -> tuple:
    """(fwd_lists, bwd_lists) of `mask` for the kernels that serve q and v's
    head dims (kept in the mask: made once per tile size)."""
    (fwd_rows, fwd_cols), (bwd_rows, bwd_cols) = _tiles(q.shape[-1], v.shape[-1])
    return (mask.tile_lists(fwd_rows, fwd_cols, transposed=False),
            mask.tile_lists(bwd_rows, bwd_cols, transposed=True))


def check_mask_shape(mask: BlockSparseMask, q: torch.Tensor, k: torch.Tensor) -> None:
    """A clear error for a mask made for another problem."""
    batch, seqlen_q, heads, _ = q.shape
    if (mask.seqlen_q, mask.seqlen_k) != (seqlen_q, k.shape[1]) \
            or mask.batch not in (1, batch) or mask.heads not in (1, heads) \
            or mask.device != q.device:
        raise ValueError(f"block_mask: expected a mask for batch {batch} (or 1), nheads {heads} "
                         f"(or 1), seqlen_q {seqlen_q}, seqlen_k {k.shape[1]} on {q.device}, "
                         f"got batch {mask.batch}, nheads {mask.heads}, seqlen_q "
                         f"{mask.seqlen_q}, seqlen_k {mask.seqlen_k} on {mask.device}")


def _tiles(head_dim: int, head_dim_v: int) -> tuple:
    return block_sparse_tiles(kernel_head_dim(head_dim), kernel_head_dim(head_dim_v))


def _check_lists(name: str, lists, q: torch.Tensor, rows: int, length: int) -> None:
    """The packed lists of one direction: int32 (batch or 1, (nheads or 1) ·
    ceil(length / rows), words) on q's device, rows of 16-byte multiples."""
    batch, heads = q.shape[0], q.shape[2]
    tiles = -(-length // rows)
    ok = (isinstance(lists, torch.Tensor) and lists.dim() == 3 and lists.dtype == torch.int32
          and lists.device == q.device and lists.shape[0] in (1, batch)
          and lists.shape[1] in (tiles, heads * tiles) and lists.shape[2] % 4 == 0
          and lists.shape[2] >= 4 and lists.stride(2) == 1 and lists.stride(1) % 4 == 0
          and lists.stride(0) % 4 == 0)
    if not ok:
        raise ValueError(f"{name}: expected the int32 tile lists of a BlockSparseMask "
                         f"(block_sparse_ops.lists_for) for this problem, (batch or 1, (nheads "
                         f"or 1) * {tiles}, words), words a multiple of 4, contiguous, on "
                         f"{q.device}, got {describe(lists)}")


def _check_fwd(q, k, v, fwd_lists, bwd_lists, softmax_scale, softcap, learnable_sink):
    check_attention_inputs(q, k, v, softmax_scale)
    check_score_args(-1, -1, softcap)
    check_sink(learnable_sink, q.shape[2], q.device)
    (fwd_rows, _), (bwd_rows, _) = _tiles(q.shape[3], v.shape[3])
    _check_lists("fwd_lists", fwd_lists, q, fwd_rows, q.shape[1])
    _check_lists("bwd_lists", bwd_lists, q, bwd_rows, k.shape[1])


def _variant(q, k, softcap: float, learnable_sink):
    """The score variant of a call (its NVTX name on the CPU path)."""
    return resolve(False, -1, -1, softcap, q.shape[1], k.shape[1],
                   sink=learnable_sink is not None, block_sparse=True)


def _visible(lists: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The boolean mask the forward lists describe (for the reference)."""
    (rows, cols), _ = _tiles(q.shape[3], v.shape[3])
    return lists_dense(lists, rows, cols, False, q.shape[1], k.shape[1])


_lib = ops._lib
_SCORE_ARGS = "float softcap=0.0, Tensor? learnable_sink=None"
_lib.define("block_sparse_fwd(Tensor q, Tensor k, Tensor v, Tensor fwd_lists, Tensor bwd_lists, "
            f"float? softmax_scale=None, {_SCORE_ARGS}) -> (Tensor, Tensor)")
_lib.define("block_sparse_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
            "Tensor lse, Tensor fwd_lists, Tensor bwd_lists, float softmax_scale, "
            f"Tensor? grad_lse=None, {_SCORE_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")


def _check_bwd(grad_out, q, k, v, out, lse, fwd_lists, bwd_lists, softmax_scale, grad_lse,
               softcap, learnable_sink):
    check_backward_inputs(grad_out, q, k, v, out, lse, softmax_scale, grad_lse)
    _check_fwd(q, k, v, fwd_lists, bwd_lists, softmax_scale, softcap, learnable_sink)


def _fwd_cpu(q, k, v, fwd_lists, bwd_lists, softmax_scale=None, softcap=0.0,
             learnable_sink=None):
    _check_fwd(q, k, v, fwd_lists, bwd_lists, softmax_scale, softcap, learnable_sink)
    scores = _variant(q, k, softcap, learnable_sink)
    with nvtx_ranges.op_range(nvtx_ranges.range_name("block_sparse_fwd", q, v, False, scores)):
        out, lse = attention_reference(q, k, v, resolve_scale(q, softmax_scale), softcap=softcap,
                                       sink=learnable_sink,
                                       visible=_visible(fwd_lists, q, k, v))
    return out.contiguous(), lse.contiguous()


def _fwd_cuda(q, k, v, fwd_lists, bwd_lists, softmax_scale=None, softcap=0.0,
              learnable_sink=None):
    _check_fwd(q, k, v, fwd_lists, bwd_lists, softmax_scale, softcap, learnable_sink)
    return ops.forward_cuda(q, k, v, resolve_scale(q, softmax_scale), False, softcap=softcap,
                            learnable_sink=learnable_sink, block_lists=fwd_lists)


def _fwd_fake(q, k, v, fwd_lists, bwd_lists, softmax_scale=None, softcap=0.0,
              learnable_sink=None):
    _check_fwd(q, k, v, fwd_lists, bwd_lists, softmax_scale, softcap, learnable_sink)
    batch, seqlen_q, heads, _ = q.shape
    return (q.new_empty((batch, seqlen_q, heads, v.shape[3])),
            torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device))


def _bwd_cpu(grad_out, q, k, v, out, lse, fwd_lists, bwd_lists, softmax_scale, grad_lse=None,
             softcap=0.0, learnable_sink=None):
    _check_bwd(grad_out, q, k, v, out, lse, fwd_lists, bwd_lists, softmax_scale, grad_lse,
               softcap, learnable_sink)
    scores = _variant(q, k, softcap, learnable_sink)
    with nvtx_ranges.op_range(nvtx_ranges.range_name("block_sparse_bwd", q, v, False, scores)):
        grads = attention_backward_reference(grad_out, q, k, v, out, lse, softmax_scale, False,
                                             grad_lse, softcap=softcap, sink=learnable_sink,
                                             visible=_visible(fwd_lists, q, k, v))
    return ops.op_grads(tuple(g.contiguous() for g in grads), q)


def _bwd_cuda(grad_out, q, k, v, out, lse, fwd_lists, bwd_lists, softmax_scale, grad_lse=None,
              softcap=0.0, learnable_sink=None):
    _check_bwd(grad_out, q, k, v, out, lse, fwd_lists, bwd_lists, softmax_scale, grad_lse,
               softcap, learnable_sink)
    return ops.op_grads(ops.backward_cuda(grad_out, q, k, v, out, lse, softmax_scale, False,
                                          grad_lse, False, softcap=softcap,
                                          learnable_sink=learnable_sink,
                                          block_lists=bwd_lists), q)


def _bwd_fake(grad_out, q, k, v, out, lse, fwd_lists, bwd_lists, softmax_scale, grad_lse=None,
              softcap=0.0, learnable_sink=None):
    _check_bwd(grad_out, q, k, v, out, lse, fwd_lists, bwd_lists, softmax_scale, grad_lse,
               softcap, learnable_sink)
    return ops.fake_grads(q, k, v, learnable_sink)


ops.register_kernels("block_sparse_fwd", _fwd_cpu, _fwd_cuda, _fwd_fake)
ops.register_kernels("block_sparse_bwd", _bwd_cpu, _bwd_cuda, _bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, fwd_lists, bwd_lists, softmax_scale, softcap, learnable_sink = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, fwd_lists, bwd_lists, learnable_sink)
    ctx.softmax_scale, ctx.softcap = resolve_scale(q, softmax_scale), softcap
    ctx.set_materialize_grads(False)  # an unused LSE output gives grad_lse None


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, fwd_lists, bwd_lists, learnable_sink = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsink = torch.ops.cute_fa.block_sparse_bwd(
        grad_out.contiguous(), q, k, v, out, lse, fwd_lists, bwd_lists, ctx.softmax_scale,
        grad_lse, ctx.softcap, learnable_sink)
    return (dq, dk, dv, None, None, None, None,
            dsink if learnable_sink is not None else None)


torch.library.register_autograd("cute_fa::block_sparse_fwd", _backward,
                                setup_context=_setup_context, lib=_lib)
