"""Attention against a KV cache (inference): `flash_attn_with_kvcache` and the
op `torch.ops.cute_fa.fwd_kvcache`, FlashAttention-3's names and semantics.

q (batch, seqlen_q, nheads, d) attends to each sequence's cache: a
contiguous cache (batch_cache, seqlen_cache, nheads_kv, d), row
cache_batch_idx[b] (default b) for sequence b, or a paged one (num_pages,
page_size, nheads_kv, d) whose pages page_table[b, :] (int32, (batch,
max_pages)) hold sequence b in order. cache_seqlens (int32 (batch,), or one
int) says how many tokens each cache holds; new k, v (batch, seqlen_new,
nheads_kv, d) are written into the cache at those positions, in place,
before attending, and sequence b then sees cache_seqlens[b] + seqlen_new
keys. causal aligns the queries to the end of each sequence's keys.

The attention runs on the forward kernel over packed sequences
(decode.py): each sequence's keys are found by their first cache row and
their length (seqused_k), so nothing is read on the host and a decode step
is captured in a CUDA graph whole. The query heads that share a KV head are
packed into the rows of one tile (GQA packing), a sequence's keys are split
over CTAs when the batch leaves SMs idle (split-KV, num_splits), and a
paged cache is read in place through its page table: pages of 8 to 64
tokens one TMA load per page, larger ones (multiples of 128) one per 128
keys, other multiples of 16 below 128 a main-loop step of one page. Other
page sizes, and head dims the kernels pad, are copied first (a gather of
each sequence's pages; a padded copy). A contiguous cache whose length is
a multiple of the kernel's key block (128 keys; 64 above head dim 128) is
read the same way, one page per cache row (cache_batch_idx, or the batch
index, its page table).

FP8: q, k_cache, v_cache (and new k, v) all torch.float8_e4m3fn, with
q_descale, k_descale, v_descale fp32 (batch, nheads_kv) (x ≈ x8 · descale,
fp8.py; None: 1), as FlashAttention-3 takes them; out is then bf16. The
same kernel with e4m3 operands (the FP8 forward's: Q·Kᵀ and P·V on FP8
WGMMA, V transposed in shared memory), descales folded into the score
scale and O; head dims of the FP8 forward (kernels.config.FP8_HEAD_DIMS),
v's that of q. Half the bytes of a 16-bit cache to read.

What is checked: shapes, dtypes, devices, head counts and head dims, the
softmax scale, contiguous pages. The values of cache_seqlens, page_table and
cache_batch_idx are checked on the CPU; on the GPU reading them would stall
every decode step, so they are not: a length beyond the cache is cut at the
cache's end, and new tokens that would land past it are not written (page
and row indices must be in range, as in FlashAttention).
"""

from __future__ import annotations

import torch

from . import compile_cache, decode, ops, reference
from . import nvtx as nvtx_ranges
from .fp8_ops import E4M3, E4M3_OUT, check_descales, kernel_descales
from .kernels.config import FP8_HEAD_DIMS
from .validate import (SUPPORTED_DTYPES, check_head_dims, check_scale_type,
                       check_softmax_scale, check_tensor_types, describe)

_lib = ops._lib
_lib.define("fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k=None, "
            "Tensor? v=None, Tensor? cache_seqlens=None, Tensor? page_table=None, "
            "Tensor? cache_batch_idx=None, float? softmax_scale=None, bool causal=False, "
            "int num_splits=0, Tensor? q_descale=None, Tensor? k_descale=None, "
            "Tensor? v_descale=None) -> (Tensor, Tensor)")


def check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, page_table,
                         cache_batch_idx, num_splits, q_descale=None, k_descale=None,
                         v_descale=None, softmax_scale=None) -> None:
    """Shapes, dtypes and devices (no values: see the module's docstring)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D torch.Tensor, got {describe(t)}")
        if (t.dtype not in SUPPORTED_DTYPES and t.dtype != E4M3) or t.dtype != q.dtype \
                or t.device != q.device:
            raise TypeError(f"{name}: expected dtype bfloat16, float16 or float8_e4m3fn, that "
                            f"of q, on {q.device}, got {describe(t)}")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected the last dimension to be contiguous, got "
                             f"strides {tuple(t.stride())}")
    batch, seqlen_q, heads, head_dim = q.shape
    if k_cache.shape[2:] != v_cache.shape[2:3] + (head_dim,) or k_cache.shape[:2] != \
            v_cache.shape[:2] or v_cache.shape[3] > head_dim:
        raise ValueError(f"k_cache, v_cache: expected (*, *, nheads_kv, {head_dim}) and the "
                         f"same with v's head dim, got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if q.dtype != E4M3:  # e4m3's head dims: _check_descales
        check_head_dims(head_dim, v_cache.shape[3], "q", "v_cache")
    check_softmax_scale(softmax_scale)
    heads_kv = k_cache.shape[2]
    if heads_kv == 0 or heads % heads_kv:
        raise ValueError(f"k_cache: expected nheads_kv to divide nheads = {heads}, got "
                         f"{heads_kv}")
    if seqlen_q == 0 or heads == 0:
        raise ValueError(f"q: expected seqlen_q and nheads >= 1, got {tuple(q.shape)}")
    if (k is None) != (v is None):
        raise ValueError("k, v: expected both or neither")
    if k is not None:
        for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != batch \
                    or t.shape[2:] != cache.shape[2:] or t.dtype != q.dtype \
                    or t.device != q.device:
                raise ValueError(f"{name}: expected (batch={batch}, seqlen_new, "
                                 f"{cache.shape[2]}, {cache.shape[3]}) {q.dtype} on "
                                 f"{q.device}, got {describe(t)}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k, v: expected one seqlen_new, got {k.shape[1]} and "
                             f"{v.shape[1]}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens: expected the cache lengths where new k, v are "
                             "written, got None")
    _check_index("cache_seqlens", cache_seqlens, (batch,), q.device)
    _check_index("cache_batch_idx", cache_batch_idx, (batch,), q.device)
    if page_table is None and cache_batch_idx is None and k_cache.shape[0] != batch:
        raise ValueError(f"k_cache: expected batch_cache = {batch} (that of q) without "
                         f"cache_batch_idx or page_table, got {k_cache.shape[0]}")
    if page_table is not None:
        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2:
            raise ValueError(f"page_table: expected an int32 tensor (batch, max_pages), got "
                             f"{describe(page_table)}")
        _check_index("page_table", page_table, (batch, page_table.shape[-1]), q.device)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: expected None with a page_table (the table "
                             "names each sequence's pages)")
        if not k_cache.is_contiguous() or not v_cache.is_contiguous():
            raise ValueError("k_cache, v_cache: expected contiguous pages (num_pages, "
                             "page_size, nheads_kv, d) with a page_table")
    check_num_splits(num_splits)
    _check_descales(q, heads_kv, v_cache.shape[3], q_descale, k_descale, v_descale)


def check_num_splits(num_splits) -> None:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0: chosen from the shapes), got "
                         f"{num_splits!r}")


def _check_descales(q, heads_kv, head_dim_v, q_descale, k_descale, v_descale) -> None:
    descales = (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
    if q.dtype != E4M3:
        for name, d in descales:
            if d is not None:
                raise ValueError(f"{name}: expected None for {q.dtype} inputs (descales "
                                 f"belong to float8_e4m3fn ones), got {describe(d)}")
        return
    head_dim = q.shape[3]
    if head_dim not in FP8_HEAD_DIMS or head_dim_v != head_dim:
        raise ValueError(f"q, v_cache: expected headdim one of {FP8_HEAD_DIMS}, v's that of q, "
                         f"for float8_e4m3fn inputs, got {head_dim} and {head_dim_v}")
    check_descales(q, heads_kv, q_descale, k_descale, v_descale)


def _out_dtype(q) -> torch.dtype:
    return E4M3_OUT if q.dtype == E4M3 else q.dtype


def _check_index(name, t, shape, device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != shape \
            or t.device != device:
        raise ValueError(f"{name}: expected an int32 tensor of shape {shape} on {device}, got "
                         f"{describe(t)}")


def _check_values(k_cache, k, cache_seqlens, page_table, cache_batch_idx, paged) -> None:
    """The index values, where reading them costs nothing (CPU tensors)."""
    capacity = k_cache.shape[1] * (page_table.shape[1] if paged else 1)
    new = 0 if k is None else k.shape[1]
    if cache_seqlens is not None and ((cache_seqlens < 0) | (cache_seqlens + new > capacity)
                                      ).any():
        raise ValueError(f"cache_seqlens: expected each in [0, {capacity - new}] (the cache "
                         f"holds {capacity} tokens, {new} new), got {cache_seqlens.tolist()}")
    limit = k_cache.shape[0]  # pages, or cache rows
    name, table = ("page_table", page_table) if paged else ("cache_batch_idx", cache_batch_idx)
    if table is not None and ((table < 0) | (table >= limit)).any():
        raise ValueError(f"{name}: expected entries in [0, {limit}), got "
                         f"{table.flatten()[:16].tolist()}")



def append_to_cache(k_cache, v_cache, k, v, cache_seqlens, page_table,
                    cache_batch_idx) -> torch.Tensor:
    """k, v written into the caches at cache_seqlens, in place, with no host
    sync (a CUDA graph captures it); returns the new lengths, cache_seqlens
    + seqlen_new (int32). A position outside a cache (past its end, or
    below 0) is not written. On a GPU one launch (cute_kernels/
    cache_append.py) where every row is whole 16-byte pieces; otherwise
    fixed-shape index writes, no masks: a position outside is sent, with
    that slot's own value, to a slot where no new token of its sequence
    lands (the first where they start past 0, else the last; for calls of
    fewer new tokens than a cache holds)."""
    if k.shape[0] == 0 or k.shape[1] == 0:  # nothing to write (and no empty grid)
        return cache_seqlens
    if _appends_in_one_launch(k_cache, v_cache, k, v):
        table = (page_table if page_table is not None
                 else decode.row_pages(cache_batch_idx, k.shape[0], k.device))
        lengths = torch.empty_like(cache_seqlens)
        compile_cache.get_append(k.dtype, k.shape[3], v.shape[3]).fn(
            k, v, k_cache, v_cache, table, cache_seqlens, lengths)
        return lengths
    batch, new = k.shape[:2]
    capacity = k_cache.shape[1] * (1 if page_table is None else page_table.shape[1])
    if capacity == 0:  # no slot to write
        return cache_seqlens + new
    starts = cache_seqlens[:, None].long()
    positions = starts + torch.arange(new, device=k.device)
    inside = (positions >= 0) & (positions < capacity)
    target = torch.where(inside, positions, torch.where(starts > 0, 0, capacity - 1))
    if page_table is not None:
        page_size = k_cache.shape[1]
        rows = page_table.long().gather(1, target // page_size)
        slots = target % page_size
    else:
        slots = target
        owners = (torch.arange(batch, device=k.device) if cache_batch_idx is None
                  else cache_batch_idx.long())
        rows = owners[:, None].expand(batch, new)
    keep = inside[..., None, None]
    for cache, values in ((k_cache, k), (v_cache, v)):
        if cache.dtype == E4M3:  # moved as bytes (torch.where takes no e4m3)
            cache, values = cache.view(torch.uint8), values.view(torch.uint8)
        cache[rows, slots] = torch.where(keep, values, cache[rows, slots])
    return cache_seqlens + new


_PIECE_BYTES = 16  # cache_append.PIECE_BYTES (that module imports the DSL)


def _appends_in_one_launch(*tensors) -> bool:
    """Whether the append kernel takes these caches and new k, v: on a GPU,
    every row (the last dimension, contiguous) whole 16-byte pieces at
    16-byte aligned addresses."""
    for t in tensors:
        piece = _PIECE_BYTES // t.element_size()
        if t.device.type != "cuda" or t.stride(-1) != 1 or t.data_ptr() % _PIECE_BYTES \
                or any(stride % piece for stride in t.stride()[:-1]) or t.shape[-1] % piece:
            return False
    return True


def _sequences(k_cache, v_cache, page_table, in_place: bool):
    """The caches as the kernels take them and the most keys one sequence
    holds. A paged cache the kernel reads in place (in_place) stays as it
    is; otherwise its pages are gathered into contiguous sequences first (a
    copy). Contiguous sequences become one token axis (1, rows, nheads_kv,
    d): a view (a copy only where the batch and token axes do not flatten
    into one)."""
    if page_table is not None:
        if in_place:
            return k_cache, v_cache, page_table.shape[1] * k_cache.shape[1]
        pages = page_table.long()
        k_cache, v_cache = (c[pages].flatten(1, 2) for c in (k_cache, v_cache))
    keys, values = (c.flatten(0, 1).unsqueeze(0) for c in (k_cache, v_cache))
    return keys, values, k_cache.shape[1]


def _reference(q, keys, values, cache_rows, lengths, capacity, scale, causal, descales):
    """The CPU path: reference math over the same sequences the kernels see.
    e4m3 (descales (q, k, v), each (batch, nheads_kv) or None): on the
    dequantized values, a sequence's k descale folded into its q and its v
    descale into its output (a cache row may serve sequences of other
    descales)."""
    batch, seqlen_q, heads, _ = q.shape
    steps = torch.arange(batch + 1, dtype=torch.int32)
    rows = steps[:batch] if cache_rows is None else cache_rows
    starts = rows * capacity
    fp8 = q.dtype == E4M3
    group = heads // keys.shape[2]
    if fp8:
        q_descale, k_descale, v_descale = (
            torch.ones(batch, keys.shape[2]) if d is None else d for d in descales)
        q = q.float() * (q_descale * k_descale).repeat_interleave(group, 1)[:, None, :, None]
        keys, values = keys.float(), values.float()
    out, lse = reference.varlen_attention_reference(
        q.reshape(batch * seqlen_q, heads, -1), keys[0], values[0], steps * seqlen_q,
        torch.cat([starts, starts[-1:]]), scale, causal, seqused_k=lengths)
    out = out.view(batch, seqlen_q, heads, -1)
    if fp8:
        if descales[2] is not None:
            out = out * descales[2].repeat_interleave(group, 1)[:, None, :, None]
        out = out.to(E4M3_OUT)
    return out, lse.view(heads, batch, seqlen_q).transpose(0, 1).contiguous()


def _forward(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None,
             cache_batch_idx=None, softmax_scale=None, causal=False, num_splits=0,
             q_descale=None, k_descale=None, v_descale=None):
    check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, page_table,
                         cache_batch_idx, num_splits, q_descale, k_descale, v_descale,
                         softmax_scale)
    descales = (q_descale, k_descale, v_descale)
    paged = page_table is not None
    if q.device.type == "cpu":
        _check_values(k_cache, k, cache_seqlens, page_table, cache_batch_idx, paged)
    batch, seqlen_q, heads, head_dim = q.shape
    scale = reference.resolve_scale(q, softmax_scale)
    name = nvtx_ranges.kvcache_range_name(q, k_cache, page_table, causal)
    with nvtx_ranges.op_range(name):
        lengths = cache_seqlens  # None: every cache full
        if k is not None:  # the lengths after the new tokens
            lengths = append_to_cache(k_cache, v_cache, k, v, cache_seqlens, page_table,
                                      cache_batch_idx)
        on_gpu = q.device.type == "cuda"
        in_place = paged and on_gpu and decode.reads_pages_in_place(
            k_cache.shape[1], head_dim, v_cache.shape[3], q.dtype == E4M3)
        if not paged and on_gpu and decode.reads_rows_as_pages(k_cache, v_cache, head_dim):
            page_table = decode.row_pages(cache_batch_idx, batch, q.device)
            cache_batch_idx, paged, in_place = None, True, True
        keys, values, capacity = _sequences(k_cache, v_cache, page_table, in_place)
        if lengths is not None and not in_place:
            # pages read in place (a contiguous cache's rows too): the kernel cuts
            # each length at the end of its pages itself (cute_kernels/varlen.py,
            # Seqlens), one launch less
            lengths = lengths.clamp(0, capacity)
        if not on_gpu:
            if lengths is None:
                lengths = torch.full((batch,), capacity, dtype=torch.int32)
            return _reference(q, keys, values, cache_batch_idx, lengths, capacity, scale,
                              causal, descales)
        if capacity == 0:  # no keys: output 0, LSE -inf
            return (torch.zeros((batch, seqlen_q, heads, v_cache.shape[3]),
                                dtype=_out_dtype(q), device=q.device),
                    ops.keyless_lse((batch, heads, seqlen_q), 0, None, q.device))
        return decode.run(q, keys, values, cache_batch_idx, page_table if in_place else None,
                          lengths, capacity, scale, causal, num_splits,
                          kernel_descales(batch, keys.shape[2], *descales, q.device)
                          if q.dtype == E4M3 else None)


def _fake(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None,
          cache_batch_idx=None, softmax_scale=None, causal=False, num_splits=0,
          q_descale=None, k_descale=None, v_descale=None):
    check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, page_table,
                         cache_batch_idx, num_splits, q_descale, k_descale, v_descale,
                         softmax_scale)
    batch, seqlen_q, heads, _ = q.shape
    return (torch.empty((batch, seqlen_q, heads, v_cache.shape[3]), dtype=_out_dtype(q),
                        device=q.device),
            torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device))


ops.register_kernels("fwd_kvcache", _forward, _forward, _fake)


_OPTIONAL_TENSORS = ("k", "v", "cache_seqlens", "page_table", "cache_batch_idx", "q_descale",
                     "k_descale", "v_descale")
_CACHE_SEQLENS = _OPTIONAL_TENSORS.index("cache_seqlens")


def _check_argument_types(optional: tuple, softmax_scale, num_splits) -> None:
    """The types the dispatcher would otherwise reject with its schema, each
    named. A decode step's host time counts: the loop accepts a valid call
    in ~0.4 us, where the named checks take ~1.4, so they run only for what
    the loop does not accept at a glance (what they then pass, a NumPy
    float scale say, goes on to the op as before)."""
    for t in optional:
        if t is not None and not isinstance(t, torch.Tensor):
            break
    else:
        if (softmax_scale is None or type(softmax_scale) in (float, int)) \
                and type(num_splits) is int:
            return
    cache_seqlens = optional[_CACHE_SEQLENS]
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected an int32 tensor (batch,), an int or None, "
                        f"got {type(cache_seqlens).__name__}")
    check_tensor_types(_OPTIONAL_TENSORS, *optional, optional=True)
    check_scale_type(softmax_scale)
    check_num_splits(num_splits)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            page_table=None, cache_batch_idx=None, softmax_scale=None,
                            causal=False, num_splits=0, return_softmax_lse=False,
                            q_descale=None, k_descale=None, v_descale=None):
    """Attention of q against a KV cache, appending k, v first (the module's
    docstring has the layouts). Returns out (batch, seqlen_q, nheads, d_v),
    and with return_softmax_lse the fp32 LSE (batch, nheads, seqlen_q).
    Inference only: no gradient. num_splits: key ranges per (sequence, KV
    head) computed by different CTAs and merged exactly (flash-decoding);
    0 chooses it from the shapes and the SM count (decode.choose_splits),
    1 never splits; at most 128 and the cache's 128-key blocks. e4m3 q and
    caches take q_descale, k_descale, v_descale (batch, nheads_kv) fp32 (None:
    1) and give a bf16 out."""
    check_tensor_types(("q", "k_cache", "v_cache"), q, k_cache, v_cache)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=q.device)
    _check_argument_types((k, v, cache_seqlens, page_table, cache_batch_idx, q_descale,
                           k_descale, v_descale), softmax_scale, num_splits)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k, v)):
        raise NotImplementedError("flash_attn_with_kvcache: inference only, no gradient "
                                  "(call it under torch.no_grad())")
    out, lse = torch.ops.cute_fa.fwd_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
                                             page_table, cache_batch_idx, softmax_scale,
                                             bool(causal), num_splits, q_descale, k_descale,
                                             v_descale)
    return (out, lse) if return_softmax_lse else out
