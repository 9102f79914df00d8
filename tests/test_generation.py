"""Generation with a KV cache (generation.py) on the CPU: greedy tokens from
the cache equal those of recomputing the whole sequence at every step, for
our paged cache (the op's CPU path) and SDPA's contiguous one; the cache
holds what was appended; bad backends and capacities are refused."""

import pytest
import torch

from cute_fa.generation import KVCache, forward_with_cache, greedy_generate
from cute_fa.model import TINY, Transformer


def _model(backend):
    torch.manual_seed(0)
    return Transformer(TINY, backend=backend).to(torch.bfloat16).eval()


def _recomputed(model, prompt, new_tokens):
    tokens = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            tokens = torch.cat([tokens, model(tokens)[:, -1:].argmax(-1)], dim=1)
    return tokens


@pytest.mark.parametrize("backend,page_size", [("cute", 16), ("cute", 8), ("sdpa", None)])
def test_cached_generation_matches_recomputation(backend, page_size):
    model = _model(backend)
    prompt = torch.randint(0, TINY.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    cache = KVCache.allocate(TINY, 3, 40, backend, page_size=page_size or 16)
    result = greedy_generate(model, prompt, 9, cache)
    assert torch.equal(result.tokens, _recomputed(model, prompt, 9))
    assert cache.lengths.tolist() == [19] * 3  # the last token is not fed back
    assert len(result.step_ms) == 8 and result.prefill_ms > 0


def test_logits_with_a_cache_match_the_whole_forward():
    model = _model("cute")
    tokens = torch.randint(0, TINY.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    cache = KVCache.allocate(TINY, 2, 32, "cute", page_size=8)
    with torch.no_grad():
        first = forward_with_cache(model, tokens[:, :13], cache)
        rest = forward_with_cache(model, tokens[:, 13:], cache)
        whole = model(tokens)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole, atol=2e-2, rtol=2e-2)


def test_bad_backend_and_capacity_are_refused():
    with pytest.raises(ValueError, match="backend"):
        KVCache.allocate(TINY, 1, 16, "fa4")
    with pytest.raises(ValueError, match="capacity"):
        KVCache.allocate(TINY, 1, TINY.max_seq_len + 1, "cute")
