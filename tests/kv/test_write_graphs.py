"""CUDA graphs of the device write path (``certvllm.kv.write_graphs``).

CPU: the token buckets and the refusal of a non-CUDA device. GPU (``pytest -m gpu``): two layers written over
a sequence of steps (a prefill beyond the graphed size, decode steps whose token counts change and repeat so that
graphs are captured and replayed, padding slots, a token completing its block, keys and values as strided views)
leave bit for bit the shadow, pages and write generations that ``write_tokens_on_device`` leaves on twin caches,
and, with write-through promotion pools (one slot per page), the same pool keys and tags.
"""

from __future__ import annotations

import pytest
import torch

from certvllm.formats.pages import PageLayout
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.write_graphs import WriteGraphs, token_bucket


def test_token_bucket_is_the_next_power_of_two():
    assert [token_bucket(t) for t in (1, 2, 3, 4, 5, 8, 9, 64, 65, 1000)] == [1, 2, 4, 4, 8, 8, 16, 64, 128, 1024]
    with pytest.raises(ValueError, match="at least one token"):
        token_bucket(0)


def test_write_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA device"):
        WriteGraphs("cpu", 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_pool", [False, True])
def test_graphed_writes_equal_the_eager_device_writes(gen, with_pool):
    from certvllm.kv.cuda_pagein import write_tokens_on_device
    from certvllm.kv.promotion_cache import PromotionCache

    dev = torch.device("cuda")
    lay, heads, d, block = PageLayout(64), 3, 64, 16

    def new_cache() -> LayerKVCache:
        pages = torch.zeros(16, heads, lay.page_bytes, dtype=torch.uint8, device=dev)
        shadow = torch.zeros(16, heads, 2, block, d, dtype=torch.bfloat16).pin_memory()
        cache = LayerKVCache(pages, shadow, lay)
        cache.enable_generations()
        return cache

    eager = [new_cache(), new_cache()]
    graphed = [new_cache(), new_cache()]
    pools = {id(c): PromotionCache(c, c.num_blocks * heads) if with_pool else None for c in eager + graphed}
    writes = WriteGraphs(dev, max_tokens=8)
    steps = [list(range(16, 16 + 40))]  # a prefill of 40 tokens: beyond max_tokens, written eagerly
    steps += [[56, -1, 100], [57, 101], [58, 102, 130], [59, 103, 131], [60, 104], [61, 105, 132, 140, 141]]
    steps += [[62, 106, 133], [63, 107, 134]]  # 63: the last offset of block 3, completed here
    for slots in steps:
        slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        for layer in range(2):
            kv = torch.randn(len(slots), heads, 3 * d, generator=gen).bfloat16().to(dev)
            key, value = kv[..., :d], kv[..., d : 2 * d]  # strided views, as vLLM's qkv split hands them over
            write_tokens_on_device(eager[layer], key, value, slot_t, pools[id(eager[layer])])
            writes.write(layer, graphed[layer], key, value, slot_t, pools[id(graphed[layer])])
    torch.cuda.synchronize()
    assert writes.disabled is None
    assert writes.captures == 2 * 3 and writes.replays > 0  # buckets 4, 2 and 8, per layer
    for a, b in zip(eager, graphed, strict=True):
        assert torch.equal(a.shadow, b.shadow)
        assert torch.equal(a.pages, b.pages)
        assert torch.equal(a.generation, b.generation)
        assert int(a.generation.sum()) > 0
        if with_pool:
            pa, pb = pools[id(a)], pools[id(b)]
            assert pa.write_through and bool((pa.tag >= 0).any())
            for name in ("pool", "tag", "tag_gen"):
                assert torch.equal(getattr(pa, name), getattr(pb, name)), name
