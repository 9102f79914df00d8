"""Hugging Face `transformers` models on cute_fa: `attn_implementation="cute_fa"`.

    import cute_fa.transformers_attention   # or: import transformers, then cute_fa
    model = AutoModelForCausalLM.from_config(config, attn_implementation="cute_fa")

Importing this module registers `cute_fa` with transformers' AttentionInterface
(the attention call) and AttentionMaskInterface (the mask a model builds for
it: transformers' FlashAttention one, a 2-D padding mask or None);
`import cute_fa` does the same when transformers is already imported.

A model's attention layer then calls `attention_forward`, which serves the
cases transformers' own FlashAttention path serves, as it serves them:
- a padding mask (batch, kv_len): the tokens it keeps are packed into one
  varlen batch (flash_attn_varlen_func) and the output scattered back, zeros
  at padded positions; queries are the last q_len positions of the mask
  (left padding), as transformers assumes when generating with a cache;
- sequences packed into one row (batch 1, position_ids restarting, or the
  cu_seq_lens_q/k and max_length_q/k that a data collator hands in): a
  varlen batch of those sequences, no attention across them;
- otherwise the dense flash_attn_func.
The model's sliding window (`sliding_window` tokens including the current
one: window_size = (sliding_window − 1, sliding_window − 1), the right side
cut by causal), its logit softcap and its attention sinks (`s_aux`,
gpt-oss) go to the kernels. q, k, v must be bf16 or fp16: fp32 activations
are cast to the autocast dtype or to that of the model's linear layers, as
transformers' FlashAttention does; dropout is not supported (a clear error
while training with attention dropout).
"""

from __future__ import annotations

import torch

from . import flash_attn_func, flash_attn_varlen_func

NAME = "cute_fa"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, s_aux: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query (batch, heads, q_len,
    d), key and value (batch, heads_kv, kv_len, d); returns the output
    (batch, q_len, heads, d_v) and no attention weights."""
    if dropout:
        raise NotImplementedError(f"dropout: cute_fa attention has no dropout, got {dropout} "
                                  f"(set the model's attention_dropout to 0)")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    q, k, v = _half_precision(module, q, k, v)
    causal = module.is_causal if is_causal is None else bool(is_causal)
    options = dict(softmax_scale=scaling, causal=causal,
                   window_size=_window(sliding_window, k.shape[1]),
                   softcap=float(softcap or 0.0), learnable_sink=s_aux)
    batch, q_len = q.shape[:2]

    if attention_mask is not None:
        return _padded(q, k, v, attention_mask, options), None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is None or cu_k is None:
        position_ids = kwargs.get("position_ids")
        if batch == 1 and q_len > 1 and position_ids is not None \
                and _restarts(position_ids):
            cu_q = cu_k = _cu_seqlens_from_positions(position_ids)
            max_q = max_k = None
    if cu_q is not None and cu_k is not None:
        out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                     v.reshape(-1, *v.shape[2:]), cu_q.int(), cu_k.int(),
                                     _as_int(max_q), _as_int(max_k), **options)
        return out.view(batch, q_len, *out.shape[1:]), None
    return flash_attn_func(q, k, v, **options), None


def _half_precision(module, q, k, v):
    if q.dtype in (torch.bfloat16, torch.float16):
        return q, k, v
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        target = torch.get_autocast_dtype(device_type)
    else:
        target = next((m.weight.dtype for m in module.modules()
                       if isinstance(m, torch.nn.Linear)), q.dtype)
    if target not in (torch.bfloat16, torch.float16):
        raise TypeError(f"query: cute_fa attention runs bf16 or fp16, got {q.dtype} in a "
                        f"{target} model (load it with dtype=torch.bfloat16, or run under "
                        f"autocast)")
    return q.to(target), k.to(target), v.to(target)


def _window(sliding_window: int | None, kv_len: int) -> tuple[int, int]:
    """transformers' sliding_window (tokens seen, the current one included)
    as flash_attn_func's window_size; none where it covers every key."""
    if sliding_window is None or kv_len <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, sliding_window - 1)


def _as_int(value) -> int | None:
    return None if value is None else int(value)


def _restarts(position_ids: torch.Tensor) -> bool:
    """Whether one row holds several sequences (its positions start again)."""
    positions = position_ids.reshape(-1)
    return bool((positions[1:] <= positions[:-1]).any())


def _cu_seqlens_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """A packed row's cu_seqlens: a sequence starts where the position is the
    row's smallest (0, or a model's first position id)."""
    positions = position_ids.reshape(-1)
    starts = (positions == positions.min()).nonzero().view(-1)
    end = torch.tensor([positions.numel()], device=positions.device)
    return torch.cat([starts, end]).int()


def _padded(q, k, v, attention_mask, options) -> torch.Tensor:
    """A padded batch: the kept tokens as a packed batch, the output scattered back."""
    batch, q_len, heads, _ = q.shape
    mask = attention_mask.bool()
    if k.shape[1] > mask.shape[1]:  # a static cache longer than the tokens seen
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    keys_kept = mask.reshape(-1).nonzero().view(-1)
    cu_k = _cu_seqlens(mask)
    queries = mask[:, -q_len:]  # the queries are the last positions (left padding)
    rows_kept = queries.reshape(-1).nonzero().view(-1)
    cu_q = _cu_seqlens(queries)
    out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:])[rows_kept],
                                 k.reshape(-1, *k.shape[2:])[keys_kept],
                                 v.reshape(-1, *v.shape[2:])[keys_kept], cu_q, cu_k,
                                 **options)
    padded = out.new_zeros((batch * q_len, *out.shape[1:]))
    padded[rows_kept] = out
    return padded.view(batch, q_len, *out.shape[1:])


def _cu_seqlens(mask: torch.Tensor) -> torch.Tensor:
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def register() -> None:
    """Make `attn_implementation="cute_fa"` available to transformers models."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


register()
