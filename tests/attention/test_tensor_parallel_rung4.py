"""Rung 4 under tensor parallelism (issue 21 item 2): a layer's exact recompute is decided per rank and per layer.

With ``--tensor-parallel-size`` N each worker holds H_q/N query heads and H_kv/N KV heads of every layer, and its
backend calls ``certified_attention`` on those heads only (``vllm_plugin/backend.py``: the query is viewed as
``[rows, num_heads, D]`` with vLLM's per-rank head count); the ladder's row-wide rung 4 (``epilogue.finish_rungs``:
canary or precondition over the call's report) and its recompute (``op._recompute_rows``) therefore cover one
rank's heads of one layer, from that rank's own shadow. Here the two ranks of a 2-way split are simulated by
sharding the heads of each layer's cache the way vLLM shards them (rank r: KV heads r·H_kv/N …, and their query
heads); one rank's pages of one row in one layer disagree with their shadow. Only that rank, layer and row go to
rung 4, exactly (equal to dense attention over its heads' originals); every other call is untouched (certified
within its bound), and each rank's metrics count its own decision.
"""

from __future__ import annotations

import math

import torch
from prometheus_client import CollectorRegistry

from certvllm.attention import certified_attention, dense_decode
from certvllm.config import load_config
from certvllm.formats.layout import BLOCK_SIZE
from certvllm.metrics import CertMetrics
from certvllm.testing import Case, exact_attention, make_case, paged_batch

HQ, HKV, D, RANKS, LAYERS = 8, 2, 64, 2, 3
HIT = (1, 1, 0)  # (layer, rank, row) whose pages are corrupted


def _shard(case: Case, rank: int) -> Case:
    """Rank ``rank``'s heads of ``case`` (vLLM's split: contiguous KV heads with their query-head groups)."""
    q_per, kv_per = HQ // RANKS, HKV // RANKS
    kv = slice(rank * kv_per, (rank + 1) * kv_per)
    return Case(case.family, case.q[rank * q_per : (rank + 1) * q_per], case.k[:, kv], case.v[:, kv])


def test_rung4_is_decided_per_rank_and_per_layer(gen):
    cfg, scale = load_config("default"), 1 / math.sqrt(D)
    metrics = {r: CertMetrics("tp", "0", flush_seconds=3600, registry=CollectorRegistry(), rank=str(r)) for r in
               range(RANKS)}  # fmt: skip
    results = {}
    for layer in range(LAYERS):
        cases = [make_case("random", t, HQ, HKV, D, torch.float16, gen) for t in (10 * BLOCK_SIZE, 7 * BLOCK_SIZE + 5)]
        for rank in range(RANKS):
            shards = [_shard(c, rank) for c in cases]
            cache, tables, lens = paged_batch(shards)
            if (layer, rank) == HIT[:2]:  # keys that disagree with the shadow (tests/attention: the canary test)
                lay, row = cache.layout, HIT[2]
                blocks = tables[row, : -(-int(lens[row]) // BLOCK_SIZE)]
                pages = cache.read_pages(blocks)
                pages[..., lay.k_codes : lay.k_codes + BLOCK_SIZE * lay.head_dim] = 255
                cache.write_pages(blocks, pages)
            q = torch.stack([s.q for s in shards])
            res = certified_attention(q, cache, tables, lens, cfg, scale)
            metrics[rank].record(res.report, layer)
            results[layer, rank] = (res, shards)

    for (layer, rank), (res, shards) in results.items():
        rung = res.report.rung
        for row, shard in enumerate(shards):
            if (layer, rank, row) == HIT:
                assert (rung[row] == 4).all() and res.report.canary_fail[row].all()
                assert torch.equal(res.out[row], dense_decode(shard.q, shard.k, shard.v, scale))
                continue
            assert (rung[row] <= 3).all(), (layer, rank, row, rung[row])
            exact = exact_attention(shard.q, shard.k, shard.v)
            err = torch.linalg.vector_norm(res.out[row].double() - exact, dim=-1)
            certified = rung[row] <= 2
            assert (err[certified] <= res.report.bound[row][certified].double()).all(), (layer, rank, row)

    def fallbacks(rank: int, layer: int) -> float:
        m = metrics[rank]
        m.flush()
        labels = {"model_name": "tp", "engine": "0", "reason": "canary", "layer": str(layer)}
        return m._registry.get_sample_value("vllm:cert_layer_fallbacks_total", labels) or 0.0

    counts = {(layer, rank): fallbacks(rank, layer) for layer in range(LAYERS) for rank in range(RANKS)}
    assert counts == {
        (layer, rank): float((layer, rank) == HIT[:2]) for layer in range(LAYERS) for rank in range(RANKS)
    }
