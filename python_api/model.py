"""A llama-like decoder whose attention backend is a constructor argument.

Token embedding, pre-norm blocks (RMSNorm -> attention with rotary embeddings
on q and k and GQA -> RMSNorm -> SwiGLU MLP), final RMSNorm, output head (tied
or untied). The attention backend only chooses the function that computes
softmax(q·kᵀ)·v (attention_backends.py), so the state dict is the same for
every backend and a checkpoint moves freely between them.

Context parallel (set_context_parallel): the model takes each rank's part of
the sequence (context_parallel.shard_sequence), rotates q and k by the
global positions of that part and computes attention ring-style with the
cute_fa ops (context_parallel.ring_attention); the loss is the mean over the
rank's tokens, the same count on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .attention_backends import BACKEND_NAMES, attention
from .context_parallel import ring_attention, shard_sequence


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256          # byte-level tokens
    dim: int = 1024
    n_layers: int = 24
    n_heads: int = 8               # head_dim = dim // n_heads = 128
    n_kv_heads: int = 4            # GQA: 2 query heads per K/V head
    ffn_hidden: int = 2816
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig.n_heads: expected a divisor of dim={self.dim}, "
                             f"got {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig.n_kv_heads: expected a divisor of "
                             f"n_heads={self.n_heads}, got {self.n_kv_heads}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


DEFAULT = ModelConfig()
# CPU tests: head_dim 64 (a head dim the op supports), GQA 2:1.
TINY = ModelConfig(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=256, max_seq_len=64)
# The ~1B model of the single-GPU runs and Llama-3-8B's shape (our byte-level
# vocabulary: 7.0B parameters instead of 8.0B, all but 2M of them in the blocks).
ONE_B = ModelConfig(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_hidden=8192)
LLAMA3_8B = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                        rope_theta=500000.0)


def count_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    total = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        total -= model.tok_embeddings.weight.numel()
    return total


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) \
            * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None):
    """cos, sin of shape (seq_len, head_dim // 2) for rotary embeddings."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """x: (batch, seq, heads, head_dim); rotates consecutive pairs (x0, x1) by
    the first seq rows of cos and sin (those of x's positions), or with
    (batch, seq, head_dim // 2) tables by each sequence's own rows (a KV
    cache's next positions, generation.py)."""
    x32 = x.float().unflatten(-1, (-1, 2))
    x0, x1 = x32[..., 0], x32[..., 1]
    if cos.dim() == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        cos, sin = cos[None, : x.shape[1], None, :], sin[None, : x.shape[1], None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: str = "cute"):
        super().__init__()
        if backend not in BACKEND_NAMES:
            raise ValueError(f"backend: expected one of {BACKEND_NAMES}, got {backend!r}")
        self.backend = backend
        self.n_heads, self.n_kv_heads, self.head_dim = (config.n_heads, config.n_kv_heads,
                                                        config.head_dim)
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.context_group = None  # set_context_parallel: the ring's process group

    def forward(self, x, cos, sin, cache=None):
        """cache: (generation.KVCache, this layer's index): the new tokens'
        k, v join it and the queries attend to all it holds."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scale = 1.0 / math.sqrt(self.head_dim)
        if cache is not None:
            out = cache[0].attend(cache[1], q, k, v, scale)
        elif self.context_group is not None:
            out = ring_attention(q, k, v, self.context_group, causal=True, softmax_scale=scale)
        else:
            out = attention(q, k, v, causal=True, softmax_scale=scale, backend=self.backend)
        return self.wo(out.reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, backend: str):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, backend)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig = DEFAULT, backend: str = "cute"):
        super().__init__()
        config.validate()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, backend) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.context_group = None
        self.apply(self._init)

    @classmethod
    def from_state(cls, config: ModelConfig, state: dict, backend: str = "cute",
                   device="cpu") -> "Transformer":
        """The model holding `state`'s weights on `device`, built without the
        random draw of the constructor (which `state` overwrites anyway: at
        Llama-3-8B's shape it is minutes of one CPU thread per process)."""
        with torch.device("meta"):
            model = cls(config, backend)
        model = model.to_empty(device=device)
        model.load_state_dict(state)
        # Not in the state dict: recomputed as the constructor does (on the CPU).
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
        return model

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def set_backend(self, backend: str) -> None:
        if backend not in BACKEND_NAMES:
            raise ValueError(f"backend: expected one of {BACKEND_NAMES}, got {backend!r}")
        for layer in self.layers:
            layer.attention.backend = backend

    def set_context_parallel(self, group) -> None:
        """Take each rank's part of the sequence (shard_sequence over `group`)
        from now on; None: whole sequences again. The ring runs the cute_fa
        ops whatever the backend."""
        self.context_group = group
        for layer in self.layers:
            layer.attention.context_group = group

    def forward(self, tokens, targets=None):
        """tokens (batch, seq) -> logits (batch, seq, vocab); with targets, also the
        mean cross-entropy loss. Context parallel: tokens and targets are this
        rank's part of the sequence, and so are the logits."""
        cos, sin = self.rope_cos, self.rope_sin
        seq = tokens.shape[1]
        if self.context_group is not None:
            seq *= dist.get_world_size(self.context_group)
            positions = shard_sequence(torch.arange(seq, device=tokens.device),
                                       self.context_group, dim=0)
            cos, sin = cos[positions], sin[positions]
        if seq > self.config.max_seq_len:
            raise ValueError(f"tokens: expected seq <= max_seq_len={self.config.max_seq_len}, "
                             f"got {seq}")
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss


def training_flops_per_token(config: ModelConfig, seq_len: int, n_params_no_embed: int) -> float:
    """Model FLOPs per trained token, the convention of the MFU numbers:
        6·N                         (N: parameters except the input embedding; the
                                     output head's matmul counts)
      + 3 · 4·n_layers·seq·dim / 2  (attention: QKᵀ and P·V, 2 FLOPs per MAC,
                                     causal halves, backward 2x forward)
    """
    attention = 3 * 4 * config.n_layers * seq_len * config.dim / 2
    return 6.0 * n_params_no_embed + attention


H100_BF16_DENSE_PEAK = 989.4e12  # H100 SXM, dense bf16 tensor-core peak (FLOP/s)
