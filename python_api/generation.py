"""Autoregressive generation with a KV cache in the llama-like model
(model.py): a prompt's forward (prefill) fills each layer's cache, then one
token per sequence and step (decode) attends to it.

Backends:
- "cute": paged caches (num_pages, page_size, h_kv, d) per layer and a page
  table, through flash_attn_with_kvcache (the new k, v appended in place by
  the op, split-KV and the pages read by the kernels);
- "sdpa": a contiguous cache (batch, capacity, h_kv, d) per layer, the new
  k, v written at each sequence's length, and
  torch.nn.functional.scaled_dot_product_attention over the whole capacity
  with a mask of the keys each query sees (PyTorch's own dispatch: a mask
  rules out its flash and cuDNN backends, so none is pinned).

A step reads its positions from the cache's length tensor on the device,
never on the host, so a decode step (fixed shapes) can be captured in a
CUDA graph and replayed with the next tokens copied in
(profiling.infer --generate).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kvcache import append_to_cache, flash_attn_with_kvcache

CACHE_BACKENDS = ("cute", "sdpa")


@dataclass
class KVCache:
    """Every layer's K and V for a batch of sequences, and the tokens each
    holds. Paged (cute): k, v (layers, num_pages, page_size, h_kv, d) and
    page_table (batch, pages per sequence) int32; contiguous (SDPA): k, v
    (layers, batch, capacity, h_kv, d) and page_table None."""

    k: torch.Tensor
    v: torch.Tensor
    page_table: torch.Tensor | None
    lengths: torch.Tensor  # (batch,) int32
    capacity: int
    # contiguous: the keys each of this step's queries sees, (batch, 1, new,
    # capacity), made once per step for every layer (begin_step)
    visible: torch.Tensor | None = None

    @classmethod
    def allocate(cls, config, batch: int, capacity: int, backend: str, page_size: int = 256,
                 dtype=torch.bfloat16, device=None) -> KVCache:
        if backend not in CACHE_BACKENDS:
            raise ValueError(f"backend: expected one of {CACHE_BACKENDS} for generation with a "
                             f"KV cache, got {backend!r}")
        if capacity > config.max_seq_len:
            raise ValueError(f"capacity: expected at most max_seq_len={config.max_seq_len} "
                             f"(the rotary tables' length), got {capacity}")
        kv = (config.n_kv_heads, config.head_dim)
        lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        if backend != "cute":
            shape = (config.n_layers, batch, capacity) + kv
            return cls(torch.zeros(shape, dtype=dtype, device=device),
                       torch.zeros(shape, dtype=dtype, device=device), None, lengths, capacity)
        pages = -(-capacity // page_size)
        shape = (config.n_layers, batch * pages, page_size) + kv
        table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device), table, lengths,
                   pages * page_size)

    def attend(self, layer: int, q, k, v, scale: float):
        """Append k, v (batch, s, h_kv, d) at each sequence's length and
        return the new queries' causal attention over the cache (the
        lengths move on in step_done, after every layer)."""
        if self.page_table is not None:
            return flash_attn_with_kvcache(q, self.k[layer], self.v[layer], k, v,
                                           cache_seqlens=self.lengths,
                                           page_table=self.page_table, softmax_scale=scale,
                                           causal=True)
        keys, values = self.k[layer], self.v[layer]
        append_to_cache(keys, values, k, v, self.lengths, None, None)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=self.visible, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)

    def begin_step(self, tokens: int) -> torch.Tensor:
        """The positions (batch, tokens) of a step's new tokens: each
        sequence's next ones. A contiguous cache also keeps the keys each
        sees (up to its own place) for every layer's attention."""
        device = self.lengths.device
        positions = self.lengths[:, None].long() + torch.arange(tokens, device=device)
        if self.page_table is None:
            self.visible = (torch.arange(self.capacity, device=device)
                            <= positions[:, :, None])[:, None]
        return positions

    def step_done(self, tokens: int) -> None:
        self.lengths += tokens


def forward_with_cache(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """tokens (batch, s) at each sequence's next positions -> logits (batch,
    s, vocab); their keys and values join the cache."""
    positions = cache.begin_step(tokens.shape[1])
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    x = model.tok_embeddings(tokens)
    for index, layer in enumerate(model.layers):
        x = layer(x, cos, sin, cache=(cache, index))
    cache.step_done(tokens.shape[1])
    return model.output(model.norm(x))


@dataclass
class Generation:
    tokens: torch.Tensor  # (batch, prompt + new_tokens)
    prefill_ms: float  # the prompt's forward: the time to the first new token
    step_ms: list  # each later token's decode step


def greedy_generate(model, prompt: torch.Tensor, new_tokens: int, cache: KVCache,
                    cuda_graph: bool = False) -> Generation:
    """The prompt (batch, s) and `new_tokens` greedy tokens after it, timed
    (CUDA events on a GPU, wall time on the CPU). cuda_graph: the decode
    step is captured once and replayed, its token read from a buffer."""
    cuda = prompt.device.type == "cuda"
    with torch.no_grad():
        prefill_ms, logits = timed_call(cuda, lambda: forward_with_cache(model, prompt, cache))
        token = logits[:, -1:].argmax(-1)

        def step():
            return forward_with_cache(model, token, cache)[:, -1:].argmax(-1)
        run = step
        if cuda_graph and cuda and new_tokens > 1:
            run = _captured(step, cache)
        out, step_ms = [prompt, token.clone()], []
        for _ in range(new_tokens - 1):
            ms, following = timed_call(cuda, run)
            token.copy_(following)
            out.append(following.clone())
            step_ms.append(ms)
    return Generation(torch.cat(out, dim=1), prefill_ms, step_ms)


def _captured(step, cache: KVCache):
    """step as a CUDA graph replay returning its (static) output. The warm-up
    call outside the capture (the DSL compiles, the allocator settles)
    writes one step into the cache; its length goes back, so the first
    replay writes that position again."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        cache.lengths -= 1
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    def replay():
        graph.replay()
        return static_out
    return replay


def timed_call(cuda: bool, fn):
    """(milliseconds, fn()): CUDA events around it on a GPU, wall time on the CPU."""
    if cuda:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        result = fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end), result
    start = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start) * 1e3, result
