"""Deferred device reads (``certvllm.kv.deferred``) on the CPU: snapshots, read-and-reset, the packing of
several tensors into one byte buffer, and the ``take_stats_deferred`` of the page-in engine, the promotion
pool and the step prefetcher against their synchronous ``take_stats``. The CUDA behaviour (pinned copies,
events, no synchronisation) is tested in ``tests/metrics/test_gpu_metrics.py``."""

from __future__ import annotations

import pytest
import torch

from certvllm.kv.deferred import DeferredRead, DeferredStats, ReadBatch, pack, unpack


def _mixed(gen: torch.Generator) -> list[torch.Tensor]:
    """Tensors of every width and a few awkward shapes (0-dim, empty, non-contiguous)."""
    return [
        torch.randint(-5, 5, (3, 4), generator=gen, dtype=torch.int8),
        torch.randn(3, 4, generator=gen),
        torch.rand(3, 4, generator=gen) > 0.5,
        torch.tensor(7, dtype=torch.int64),
        torch.zeros(0, 4, dtype=torch.int32),
        torch.randn(4, 3, generator=gen, dtype=torch.float64).t(),
        torch.randint(0, 100, (5,), generator=gen, dtype=torch.int32),
        torch.randn(2, 3, generator=gen).half(),
    ]


def test_a_cpu_read_is_an_immediate_snapshot(gen):
    tensors = _mixed(gen)
    read = DeferredRead(tensors)
    want = [t.clone() for t in tensors]
    for t in tensors:  # the snapshot is a copy: later writes do not reach it
        t.zero_()
    assert read.done() and not read.pinned
    got = read.values()
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device.type == "cpu" and torch.equal(a, b)


def test_pack_keeps_every_tensor_aligned_and_unpacks_bit_for_bit(gen):
    """What a CUDA read does on the device and the host, run on CPU tensors: one byte buffer, widest element
    first, each tensor at a multiple of its element size, views of the buffer on the way back."""
    tensors = _mixed(gen)
    flat, offsets = pack(tensors)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(t.numel() * t.element_size() for t in tensors)
    assert all(at % t.element_size() == 0 for t, at in zip(tensors, offsets, strict=True))
    got = unpack(flat.clone(), [(t.dtype, tuple(t.shape)) for t in tensors], offsets)
    for a, b in zip(got, tensors, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    one = torch.arange(4, dtype=torch.int64)
    flat, offsets = pack([one])
    assert offsets == [0] and flat.data_ptr() == one.data_ptr()  # one contiguous tensor: a view, no copy
    assert pack([])[0].numel() == 0 and DeferredRead([]).values() == []


def test_take_reads_and_resets_the_counters():
    counts = torch.tensor([5, 3, 2], dtype=torch.int64)
    first = DeferredRead.take(counts)
    assert counts.tolist() == [0, 0, 0]
    counts += torch.tensor([1, 1, 0])
    second = DeferredRead.take(counts)
    assert first.values()[0].tolist() == [5, 3, 2] and second.values()[0].tolist() == [1, 1, 0]


def test_deferred_stats_add_the_device_counts_to_the_host_ones():
    read = DeferredRead([torch.tensor([4, 1000], dtype=torch.int64)])
    stats = DeferredStats({"bytes": 24, "seconds": 0.5, "key_blocks": 1}, ("key_blocks", "bytes"), read)
    assert stats.done()
    assert stats.values() == {"bytes": 1024, "seconds": 0.5, "key_blocks": 5}
    assert isinstance(stats["bytes"], int) and stats["key_blocks"] == 5
    assert DeferredStats.of({"hits": 3}).values() == {"hits": 3}
    with pytest.raises(ValueError, match="one device"):
        DeferredRead([torch.zeros(1), torch.zeros(1, device="meta")])


def test_page_in_engines_defer_what_take_stats_reads():
    """The plain engine (host counts only) and the CUDA engine's device counters (run on CPU tensors here):
    the deferred counts equal the synchronous ones, and each take starts the next count from zero."""
    from certvllm.kv.cuda_pagein import CudaPageInEngine
    from certvllm.kv.pagein import PageInEngine

    def traffic(engine: PageInEngine, device_counts: bool) -> None:
        engine.stats.bytes += 4096
        engine.stats.seconds += 0.25
        engine.count_promotions(2, 1)
        if device_counts:
            for k, v, b in ((3, 1, 512), (4, 0, 256)):
                engine.add_device_counts(torch.tensor(k), torch.tensor(v), torch.tensor(b))

    for make, device_counts in ((PageInEngine, False), (lambda: CudaPageInEngine("cpu"), True)):
        sync, deferred = make(), make()
        for _ in range(2):
            traffic(sync, device_counts)
            traffic(deferred, device_counts)
            want = sync.take_stats()
            got = deferred.take_stats_deferred().values()
            assert got == {"bytes": want.bytes, "seconds": want.seconds, "key_blocks": want.key_blocks,
                           "value_blocks": want.value_blocks}  # fmt: skip
        assert deferred.take_stats_deferred().values() == {"bytes": 0, "seconds": 0.0, "key_blocks": 0,
                                                           "value_blocks": 0}  # fmt: skip
    assert got == {"bytes": 4096 + 768, "seconds": 0.25, "key_blocks": 9, "value_blocks": 2}

    # traffic inside ``uncounted`` (policy-exact tokens in the same step) is dropped; what came before is kept
    for make, device_counts in ((PageInEngine, False), (lambda: CudaPageInEngine("cpu"), True)):
        engine, once = make(), make()
        traffic(engine, device_counts)
        traffic(once, device_counts)
        with engine.uncounted():
            traffic(engine, device_counts)
            traffic(engine, device_counts)
        assert engine.take_stats_deferred().values() == once.take_stats_deferred().values()


def test_pool_and_prefetch_counters_defer_what_take_stats_reads(gen):
    from certvllm.kv.prefetch import StepPrefetcher
    from certvllm.kv.promotion_cache import PromotionCache
    from certvllm.testing import make_case, paged_batch

    cache, _, _ = paged_batch([make_case("sink_and_recency", 40, 4, 2, 32, torch.float16, gen)])
    for make in (lambda: PromotionCache(cache, 8), lambda: StepPrefetcher(32, torch.float16, cache.pages.device, 4)):
        sync, deferred = make(), make()
        for step in range(3):
            add = torch.randint(0, 50, sync.counts.shape, generator=gen)
            sync.counts += add
            deferred.counts += add
            stats = deferred.take_stats_deferred()
            assert deferred.counts.abs().sum() == 0  # zeroed behind the snapshot
            assert stats.values() == sync.take_stats(), step


def test_a_read_batch_gives_each_member_what_its_own_read_would(gen):
    """One layer call's counters and report in one read: every member gets exactly the values its own
    ``DeferredRead`` (or ``take``) would have given, the taken counters are zeroed only once the batch is issued,
    and a member cannot be read before that (nothing was queued for it)."""
    from certvllm.kv.cuda_pagein import CudaPageInEngine
    from certvllm.kv.prefetch import StepPrefetcher
    from certvllm.kv.promotion_cache import PromotionCache
    from certvllm.testing import make_case, paged_batch

    cache, _, _ = paged_batch([make_case("sink_and_recency", 40, 4, 2, 32, torch.float16, gen)])
    pools = [PromotionCache(cache, 8) for _ in range(2)]
    prefetchers = [StepPrefetcher(32, torch.float16, cache.pages.device, 4) for _ in range(2)]
    engines = [CudaPageInEngine("cpu") for _ in range(2)]
    for step in range(3):
        for pair in (pools, prefetchers):
            add = torch.randint(0, 50, pair[0].counts.shape, generator=gen)
            for owner in pair:
                owner.counts += add
        for engine in engines:
            engine.stats.bytes += 100 * step
            engine.add_device_counts(torch.tensor(step + 1), torch.tensor(2), torch.tensor(64 * step))
        report = _mixed(gen)
        batch = ReadBatch()
        joint = [pools[0].take_stats_deferred(batch), prefetchers[0].take_stats_deferred(batch),
                 engines[0].take_stats_deferred(batch)]  # fmt: skip
        member = batch.add(report)
        with pytest.raises(RuntimeError, match="before its batch was issued"):
            member.values()
        assert pools[0].counts.abs().sum() > 0  # not taken yet: the batch is not issued
        batch.issue()
        assert pools[0].counts.abs().sum() == 0 and prefetchers[0].counts.abs().sum() == 0
        alone = [pools[1].take_stats_deferred(), prefetchers[1].take_stats_deferred(),
                 engines[1].take_stats_deferred()]  # fmt: skip
        assert [s.values() for s in joint] == [s.values() for s in alone], step
        got = member.values()
        assert member.done() and len(got) == len(report)
        for a, b in zip(got, report, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        with pytest.raises(RuntimeError, match="issued already"):
            batch.add(report)


def test_pack_takes_strided_tensors() -> None:
    """A strided 1-D tensor (``reshape(-1)`` keeps it strided) and a transposed one pack to their values."""
    a = torch.arange(8, dtype=torch.float32)[::2]
    b = torch.arange(6, dtype=torch.int16).view(2, 3).t()
    buffer, offsets = pack([a, b])
    got = unpack(buffer, [(a.dtype, tuple(a.shape)), (b.dtype, tuple(b.shape))], offsets)
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
