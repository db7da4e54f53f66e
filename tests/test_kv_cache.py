"""The tiered cache: write path, engine blocks of several 16-token blocks, channel-major shadow keys."""

from __future__ import annotations

import pytest
import torch

from certvllm.attention import certified_attention
from certvllm.config import load_config
from certvllm.formats.layout import BLOCK_SIZE, PageLayout
from certvllm.formats.pages import PageReader
from certvllm.kv.cache import LayerKVCache
from certvllm.testing import exact_attention, make_case


def _engine_cache(engine_blocks: int, sub: int, heads: int, d: int, dtype, channel_major: bool) -> LayerKVCache:
    layout = PageLayout(d)
    pages = torch.zeros(engine_blocks, heads, sub * layout.page_bytes, dtype=torch.uint8)
    shadow = torch.zeros(engine_blocks, heads, 2, sub * BLOCK_SIZE, d, dtype=dtype)
    return LayerKVCache(pages, shadow, layout, keys_channel_major=channel_major)


@pytest.mark.parametrize("sub,channel_major", [(1, False), (1, True), (8, False), (8, True)])
def test_write_then_read_back_originals(sub, channel_major, gen):
    cache = _engine_cache(4, sub, 2, 64, torch.bfloat16, channel_major)
    t = 3 * BLOCK_SIZE + 5
    k, v = torch.randn(t, 2, 64, generator=gen).bfloat16(), torch.randn(t, 2, 64, generator=gen).bfloat16()
    blocks = torch.tensor([5, 2, 9, 30]) if sub == 8 else torch.tensor([3, 0, 2, 1])
    pos = torch.arange(t)
    encoded = cache.write(k, v, blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    assert sorted(encoded.tolist()) == sorted(blocks[:3].tolist())  # the partial 4th block is not encoded
    got = cache.shadow_blocks(blocks).permute(2, 0, 3, 1, 4).reshape(2, 4 * BLOCK_SIZE, 2, 64)[:, :t]
    assert torch.equal(got[0], k) and torch.equal(got[1], v)
    dec = PageReader(cache.layout).decode(cache.read_pages(blocks))
    assert dec.valid[:3].all() and not dec.valid[3].any()
    if channel_major:  # keys are stored [D, m·N] per (engine block, head), like vLLM's CPU cache
        e, s = int(blocks[0]) // sub, int(blocks[0]) % sub
        stored = cache.shadow[e, 1, 0].reshape(64, sub * BLOCK_SIZE)[:, s * BLOCK_SIZE : (s + 1) * BLOCK_SIZE]
        assert torch.equal(stored.t(), k[:BLOCK_SIZE, 1])


def test_reused_block_is_reencoded_when_it_fills_again(gen):
    cache = LayerKVCache.allocate(2, 1, 64, torch.float16)
    slots = torch.arange(BLOCK_SIZE) + BLOCK_SIZE
    first = torch.randn(BLOCK_SIZE, 1, 64, generator=gen).half()
    cache.write(first, first, slots)
    old = cache.read_pages(torch.tensor([1])).clone()
    second = torch.randn(BLOCK_SIZE, 1, 64, generator=gen).half()
    cache.write(second[:10], second[:10], slots[:10])
    assert torch.equal(cache.read_pages(torch.tensor([1])), old)  # partial: the page is not touched
    cache.write(second[10:], second[10:], slots[10:])
    assert not torch.equal(cache.read_pages(torch.tensor([1])), old)


def test_engine_blocks_give_the_same_certified_result(gen):
    case = make_case("sink_and_recency", 300, 6, 2, 64, torch.bfloat16, gen)
    pos = torch.arange(300)
    results = []
    for sub, cm in ((1, False), (8, True)):
        cache = _engine_cache(40 // sub, sub, 2, 64, torch.bfloat16, cm)
        table = torch.arange(19) + 3  # blocks 3..21
        cache.write(case.k, case.v, table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        res = certified_attention(case.q[None], cache, table[None], torch.tensor([300]), load_config())
        err = torch.linalg.vector_norm(res.out[0].double() - exact_attention(case.q, case.k, case.v), dim=-1)
        assert ((err <= res.report.bound[0]) | (res.report.rung[0] >= 3)).all()
        results.append(res)
    assert torch.equal(results[0].out, results[1].out)
    assert torch.equal(results[0].report.rung, results[1].report.rung)


def test_copy_blocks_copies_pages_and_shadows(gen):
    cache = _engine_cache(2, 8, 1, 64, torch.float16, True)
    k = torch.randn(BLOCK_SIZE, 1, 64, generator=gen).half()
    cache.write(k, k, torch.arange(BLOCK_SIZE) + 3 * BLOCK_SIZE)
    cache.copy_blocks(torch.tensor([3]), torch.tensor([12]))
    assert torch.equal(cache.shadow_blocks(torch.tensor([12])), cache.shadow_blocks(torch.tensor([3])))
    assert torch.equal(cache.read_pages(torch.tensor([12])), cache.read_pages(torch.tensor([3])))
