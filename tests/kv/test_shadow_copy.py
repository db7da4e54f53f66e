"""Copy-engine shadow writes (``certvllm.kv.shadow_copy``).

CPU: which engine blocks a write fills (``full_block_runs``), and the refusal of runs that do not fit the write or
the shadow. Interpreter (the CPU lane) and GPU (``pytest -m gpu``, real copies on a side stream into a pinned
shadow): ``write_tokens_on_device`` with the runs and a ``ShadowCopier`` leaves bit for bit the shadow, pages and
write generations that the SM stores alone leave on a twin cache, over steps that mix a chunk beginning and ending
inside blocks, a request whose blocks are not consecutive, decode tokens, one completing its block, padding slots,
and keys and values as strided views.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton", reason="triton is not installed: the device write path cannot be tested")

from certvllm.formats.layout import BLOCK_SIZE, PageLayout  # noqa: E402
from certvllm.kv.cache import LayerKVCache  # noqa: E402
from certvllm.kv.shadow_copy import ShadowCopier, ShadowRun, full_block_runs, uncovered_ranges  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_full_block_runs_are_the_blocks_the_write_fills_split_where_ids_jump():
    # positions 10 … 69 of a request whose blocks are [2, 5, 6, 7, 1]: blocks 1–3 (ids 5, 6, 7) are whole
    assert full_block_runs(100, 10, 60, [2, 5, 6, 7, 1], 16) == [ShadowRun(106, 5, 3)]
    # a prompt from position 0 over ids that jump: one run per stretch of consecutive ids
    assert full_block_runs(0, 0, 96, [3, 4, 9, 10, 11, 2], 16) == [
        ShadowRun(0, 3, 2),
        ShadowRun(32, 9, 3),
        ShadowRun(80, 2, 1),
    ]
    assert full_block_runs(7, 16, 32, [8, 4, 5], 16) == [ShadowRun(7, 4, 2)]  # a chunk on block boundaries
    assert full_block_runs(0, 3, 12, [1], 16) == []  # inside one block
    assert full_block_runs(0, 1, 16, [1, 2], 16) == []  # across a boundary, no block whole
    assert full_block_runs(5, 0, 1, [1], 16) == []  # a decode token
    with pytest.raises(ValueError, match="need 3"):
        full_block_runs(0, 0, 48, [1, 2], 16)  # the table row is too short for the write
    with pytest.raises(ValueError, match="block_size=0"):
        full_block_runs(0, 0, 16, [1], 0)


def _twin_caches(sub: int, heads: int, d: int, blocks: int = 8) -> list[LayerKVCache]:
    lay = PageLayout(d)
    caches = []
    for _ in range(2):
        pages = torch.zeros(blocks, heads, sub * lay.page_bytes, dtype=torch.uint8, device=DEV)
        shadow = torch.zeros(blocks, heads, 2, sub * BLOCK_SIZE, d, dtype=torch.bfloat16)
        cache = LayerKVCache(pages, shadow, lay)
        cache.enable_generations()
        caches.append(cache)
    return caches


def test_runs_that_do_not_fit_are_refused():
    cache = _twin_caches(1, 2, 64)[0]
    key = torch.zeros(32, 2, 64, dtype=torch.bfloat16, device=DEV)
    copier = ShadowCopier(DEV)
    for bad in (ShadowRun(20, 1, 1), ShadowRun(0, 7, 2), ShadowRun(0, 0, 0)):
        with pytest.raises(ValueError, match="does not fit"):
            copier.write(cache, key, key, [bad])
    with pytest.raises(ValueError, match="overlap"):
        copier.write(cache, key, key, [ShadowRun(0, 1, 1), ShadowRun(8, 3, 1)])
    assert copier.write(cache, key, key, []) == [(0, 32)]  # no run: every token to the SM stores


def test_uncovered_ranges_are_the_gaps_between_the_runs():
    assert uncovered_ranges(100, [(10, 30), (50, 60)]) == [(0, 10), (30, 50), (60, 100)]
    assert uncovered_ranges(60, [(50, 60), (0, 50)]) == []
    assert uncovered_ranges(5, []) == [(0, 5)]
    assert uncovered_ranges(0, []) == []


@pytest.mark.parametrize("sub", [1, pytest.param(2, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="runs compiled in pytest -m gpu")])])  # fmt: skip
def test_copy_engine_writes_equal_the_sm_stores(sub, gen):
    from certvllm.kv.cuda_pagein import write_tokens_on_device

    heads, d = 3, 64
    mn = sub * BLOCK_SIZE
    sm, dma = _twin_caches(sub, heads, d)
    copier = ShadowCopier(DEV)
    # request A: positions mn/2 + 2 … 3·mn + mn/2 + 5 over engine blocks [2, 5, 6, 7, 1] (blocks 5 and 6 whole);
    # request B: a prompt from 0 over [3, 0] (two one-block runs); then a decode token of C, padding
    a_row, a_ctx, a_len = [2, 5, 6, 7, 1], mn // 2 + 2, 3 * mn + 4
    b_row, b_len = [3, 0], 2 * mn

    def slots_of(row: list[int], first: int, n: int) -> list[int]:
        return [row[p // mn] * mn + p % mn for p in range(first, first + n)]

    step1 = slots_of(a_row, a_ctx, a_len) + [-1] + slots_of(b_row, 0, b_len) + [4 * mn + 3]
    runs1 = full_block_runs(0, a_ctx, a_len, a_row, mn) + full_block_runs(a_len + 1, 0, b_len, b_row, mn)
    assert [(r.block, r.blocks) for r in runs1] == [(5, 2), (3, 1), (0, 1)]
    # step 2: C's token completes its 16-token block; A's next chunk ends block 7 and fills block 1 (a run of one)
    a_ctx2 = a_ctx + a_len
    step2 = [4 * mn + 15] + slots_of(a_row, a_ctx2, 5 * mn - a_ctx2)
    runs2 = full_block_runs(1, a_ctx2, 5 * mn - a_ctx2, a_row, mn)
    assert [(r.token, r.block, r.blocks) for r in runs2] == [(1 + 4 * mn - a_ctx2, 1, 1)]
    for slots, runs in ((step1, runs1), (step2, runs2)):
        kv = torch.randn(len(slots), heads, 3 * d, generator=gen).bfloat16().to(DEV)  # [T, H, k|v|other]
        key, value = kv[..., :d], kv[..., d : 2 * d]  # strided views, as vLLM's qkv split hands them over
        slot_t = torch.tensor(slots, dtype=torch.int64, device=DEV)
        write_tokens_on_device(sm, key, value, slot_t)
        write_tokens_on_device(dma, key, value, slot_t, runs=runs, copier=copier)
        copier.fence()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dma.shadow, sm.shadow)
    assert torch.equal(dma.pages, sm.pages)
    assert torch.equal(dma.generation, sm.generation)
    copied = sum(r.blocks for r in runs1 + runs2) * heads * 2 * mn * d * 2
    assert copier.bytes_copied == copied
    assert int(sm.shadow.abs().sum()) > 0


def test_write_path_refuses_runs_without_a_copier():
    from certvllm.kv.cuda_pagein import write_tokens_on_device

    cache = _twin_caches(1, 2, 64)[0]
    key = torch.zeros(16, 2, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="ShadowCopier"):
        write_tokens_on_device(cache, key, key, torch.arange(16, device=DEV), runs=[ShadowRun(0, 0, 1)])
