"""Random problem shapes shared by the forward and backward GPU tests."""

import torch


def random_problem(rng, group: int | None = None) -> dict:
    """Batch 1-8, GQA ratio 1/2/8 (drawn unless given), head dim 64/128, odd and
    unequal sequence lengths, causal or not, bf16 or fp16."""
    batch = rng.randint(1, 8)
    group = rng.choice([1, 2, 8]) if group is None else group
    heads_kv = rng.choice([1, 2])
    head_dim = rng.choice([64, 128])
    seqlen_q = rng.choice([1, 17, 64, 190, 511, 777, 1500])
    seqlen_k = rng.choice([seqlen_q, 1, 33, 400, 1023, 2049])
    causal = rng.random() < 0.5
    dtype = rng.choice([torch.bfloat16, torch.float16])
    return dict(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads=heads_kv * group,
                heads_kv=heads_kv, head_dim=head_dim, dtype=dtype, causal=causal)


def cuda_qkv_grad(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype, seed):
    """Random normal q, k, v and an output gradient on the GPU, from `seed`."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, device="cuda", dtype=dtype, generator=gen)

    return (randn(batch, seqlen_q, heads, head_dim), randn(batch, seqlen_k, heads_kv, head_dim),
            randn(batch, seqlen_k, heads_kv, head_dim), randn(batch, seqlen_q, heads, head_dim))
