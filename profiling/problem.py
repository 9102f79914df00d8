"""The benchmark problem every profiling command builds the same way."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODEL_DIM = 2048  # query heads default to MODEL_DIM // head_dim


def default_heads(head_dim: int, model_dim: int = MODEL_DIM) -> int:
    return max(1, model_dim // head_dim)


def problem_shape(head_dim: int, seqlen: int, total_tokens: int,
                  heads: int | None = None) -> tuple[int, int]:
    """(batch, query heads) of a benchmark problem: batch · seqlen = total_tokens,
    heads = MODEL_DIM // head_dim unless given."""
    from .flops import batch_for
    return batch_for(total_tokens, seqlen), heads or default_heads(head_dim)


def make_qkv(batch: int, seqlen_q: int, seqlen_k: int, heads: int, heads_kv: int, head_dim: int,
             dtype: torch.dtype, seed: int | None = None, device="cuda"):
    """Random q (b, sq, h, d), k and v (b, sk, h_kv, d); seed None draws from the global RNG."""
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    q = torch.randn(batch, seqlen_q, heads, head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device=device, dtype=dtype,
                    generator=gen)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, device=device, dtype=dtype,
                    generator=gen)
    return q, k, v
