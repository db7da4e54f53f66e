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


# -- write generations and the promotion cache's lookup (pure torch; the kernels are tested in
#    tests/triton_kernels/test_triton_kernels.py and tests/triton_kernels/test_gpu.py) ----------------------
def test_every_writer_bumps_the_write_generation(gen):
    cache = _engine_cache(4, 2, 2, 64, torch.float16, False)  # 8 16-token blocks
    k = torch.randn(BLOCK_SIZE + 3, 2, 64, generator=gen).half()
    cache.write(k, k, torch.arange(BLOCK_SIZE + 3) + 2 * BLOCK_SIZE)  # off: nothing counted, nothing breaks
    assert cache.generation is None
    g = cache.enable_generations()
    assert cache.enable_generations() is g and g.shape == (8,) and not g.any()

    def changed(fn) -> set[int]:
        before = g.clone()
        fn()
        return set((g != before).nonzero().flatten().tolist())

    # a partial write (block 4, slots 3..5), then a write that completes block 3 (shadow and page)
    assert changed(lambda: cache.write_shadow(k[:3], k[:3], torch.arange(3) + 4 * BLOCK_SIZE + 3)) == {4}
    assert changed(lambda: cache.write(k[:1], k[:1], torch.tensor([4 * BLOCK_SIZE - 1]))) == {3}
    assert changed(lambda: cache.encode_completed(torch.tensor([3 * BLOCK_SIZE - 1]))) == {2}
    assert changed(lambda: cache.write_pages(torch.tensor([6]), cache.read_pages(torch.tensor([2])))) == {6}
    assert changed(lambda: cache.copy_blocks(torch.tensor([2]), torch.tensor([7]))) == {7}
    assert changed(lambda: cache.bump_generation(torch.tensor([[0, 0]]))) == {0}
    assert changed(lambda: cache.write_shadow(k[:1], k[:1], torch.tensor([-1]))) == set()  # padding only
    assert (g >= 0).all() and int(g[0]) == 2  # duplicates count twice: counters only grow


def _pool(slots: int, blocks: int = 8, heads: int = 2):
    from certvllm.kv.promotion_cache import PromotionCache

    cache = _engine_cache(blocks, 1, heads, 64, torch.float16, False)
    return cache, PromotionCache(cache, slots)


def test_promotion_cache_slots_and_bytes():
    from certvllm.kv.promotion_cache import PromotionCache, bytes_per_slot, pool_slots
    from certvllm.kv.residency import Residency

    cache = _engine_cache(100, 1, 8, 128, torch.float16, False)
    assert pool_slots(cache, 0.0) == 0 and Residency.for_layer(cache, 0.0).pool is None
    assert pool_slots(cache, 1 / 16) == 50 and pool_slots(cache, 1e-9) == 1 and pool_slots(cache, 1.0) == 800
    assert bytes_per_slot(cache) == 16 * 128 * 2 + 32
    pc = Residency.for_layer(cache, 1 / 16).pool
    assert pc.nbytes == 50 * (4096 + 32) and pc.pool.shape == (50, 16, 128)
    assert pc.generation is cache.generation  # the pool switched the cache's write generations on
    with pytest.raises(ValueError, match="at least one slot"):
        PromotionCache(cache, 0)
    # a cache capped by its host tier below the blocks the device memory was planned for: the pool also takes the
    # cut blocks' share of pool room and their pages' memory (4,096 B each here, a 4,128 B slot: 7 slots for 8
    # pages), never more than one slot per page of the cache
    page = cache.layout.page_bytes
    assert page == 4096 and pool_slots(cache, 1 / 16, planned_blocks=50) == 50  # not capped: as before
    assert pool_slots(cache, 1 / 16, planned_blocks=101) == 50 + 1 + 8 * page // bytes_per_slot(cache) == 58
    assert pool_slots(cache, 1 / 16, planned_blocks=110, values=True) == 50 + 5 + 80 * page // (2 * 4096 + 16) == 94
    assert pool_slots(cache, 1 / 16, planned_blocks=10_000) == 800
    assert Residency.for_layer(cache, 1 / 16, planned_blocks=101).pool.slots == 58


def _check_resolve(pc, cache, tables, need) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``resolve`` and check its contract by brute force; returns ``(slot_map, claim)``."""
    hit_code = 1 << 62
    slot_map, claim, hit = pc.resolve(tables, need, cache.num_blocks)
    R, K, B = need.shape
    served: dict[int, set[int]] = {}
    for r in range(R):
        for h in range(K):
            for b in range(B):
                blk = int(tables[r, b])
                e = blk * K + h
                s1, s2 = (int(x) for x in pc.slots_of(torch.tensor(e)))
                gen = int(cache.generation[blk])
                valid = [s for s in (s1, s2) if int(pc.tag[s]) == e and int(pc.tag_gen[s]) == gen]
                sm = int(slot_map[r, h, b])
                if not need[r, h, b]:
                    assert sm == -1 and not hit[r, h, b]
                    continue
                assert bool(hit[r, h, b]) == bool(valid)  # a hit iff a slot holds (e, current generation)
                if valid:
                    assert sm == valid[0] and int(claim[sm]) == e + hit_code
                if sm >= 0:
                    assert sm in (s1, s2) and int(claim[sm]) % hit_code == e
                    served.setdefault(sm, set()).add(e)
                else:  # not served: both of its slots went to other pages
                    assert int(claim[s1]) % hit_code != e and int(claim[s1]) >= 0
                    assert int(claim[s2]) % hit_code != e and int(claim[s2]) >= 0
    assert all(len(pages) == 1 for pages in served.values())  # a slot serves one page per step
    assert all(int(claim[s]) < 0 or s in served for s in range(pc.slots))  # no slot claimed for nothing
    return slot_map, claim


def _apply_fill(pc, claim) -> None:
    """What ``lookup`` does to the tags (the kernel copies the pages)."""
    fill = (claim >= 0) & (claim < 1 << 62)
    gen = pc.generation.index_select(0, torch.where(fill, claim, 0) // pc.num_kv_heads)
    pc.tag_gen.copy_(torch.where(fill, gen, pc.tag_gen))
    pc.tag.copy_(torch.where(fill, claim, pc.tag))


def test_promotion_cache_lookup_claims_hits_and_generations():
    cache, pc = _pool(slots=4)  # 8 blocks × 2 heads = 16 pages onto 4 slots
    tables = torch.tensor([[1, 3, 5], [2, 3, 7]])  # pages e = 2·block + head
    need = torch.zeros(2, 2, 3, dtype=torch.bool)
    need[0, 0, 0] = need[0, 1, 2] = need[1, 0, 0] = need[1, 0, 2] = need[1, 1, 1] = need[0, 1, 1] = True
    slot_map, claim = _check_resolve(pc, cache, tables, need)
    assert (claim < 1 << 62).all() and (slot_map >= 0).sum() >= 3  # cold: no hits; misses fill the slots
    _apply_fill(pc, claim)
    slot_map2, claim2 = _check_resolve(pc, cache, tables, need)
    assert torch.equal(slot_map2, slot_map)  # the same step again: every served page is a hit
    assert torch.equal(claim2 >= 1 << 62, claim >= 0)
    # a rewritten block is never served from the copy taken before; it is filled again
    blocks = tables.unsqueeze(1).expand(2, 2, 3)
    bumped = blocks[slot_map >= 0][0]
    cache.bump_generation(bumped.view(1))
    slot_map3, claim3 = _check_resolve(pc, cache, tables, need)
    for s in range(pc.slots):
        if int(claim2[s]) >= 0:
            page = int(claim2[s]) - (1 << 62)
            assert (int(claim3[s]) >= 1 << 62) == (page // 2 != int(bumped))  # only the rewritten one misses
    # a page that is not needed is never served, even if its slot holds it
    slot_map4, _ = _check_resolve(pc, cache, tables, torch.zeros_like(need))
    assert (slot_map4 == -1).all()


def test_promotion_cache_lookup_contract_on_random_steps():
    gen = torch.Generator().manual_seed(3)
    cache, pc = _pool(slots=7, blocks=24, heads=3)
    hits = 0
    for _ in range(12):
        tables = torch.randperm(24, generator=gen)[:10].view(2, 5)
        need = torch.rand(2, 3, 5, generator=gen) < 0.6
        _, claim = _check_resolve(pc, cache, tables, need)
        hits += int((claim >= 1 << 62).sum())
        _apply_fill(pc, claim)
        cache.bump_generation(torch.randint(0, 24, (2,), generator=gen))  # writes between steps
    assert hits > 0


def test_shadow_numa_placement_helpers(tmp_path):
    """A GPU's NUMA node is read from its PCI device in sysfs (-1 or no entry: none), and ``prefer_node`` binds an
    untouched allocation's pages to a node this machine has (node 0), refuses one it lacks, and leaves the tensor
    as it was either way."""
    from certvllm.kv.host import numa_node_of_pci, prefer_node

    dev = tmp_path / "0000:1a:00.0"
    dev.mkdir()
    (dev / "numa_node").write_text("1\n")
    one = tmp_path / "0000:3b:00.0"
    one.mkdir()
    (one / "numa_node").write_text("-1\n")
    assert numa_node_of_pci(0, 0x1A, 0, tmp_path) == 1
    assert numa_node_of_pci(0, 0x3B, 0, tmp_path) is None  # one node, or the platform does not say
    assert numa_node_of_pci(0, 0x99, 0, tmp_path) is None  # no such device
    t = torch.zeros(1 << 20, dtype=torch.float32)
    assert prefer_node(t, 0) in (True, False)  # node 0 exists; a sandbox without CAP_SYS_NICE may refuse mbind
    assert not prefer_node(t, 4095)  # a node the machine does not have
    t += 1
    assert float(t.sum()) == t.numel()
