"""A small synthetic certified layer: real encoded pages, the serving write path and a worker's residency,
and calls over block tables of any width that repeat its few block ids.

Used by the startup warm-up (``warmup.py``), which must reach every kernel variant of a server without the
server's memory: a 128K-token row needs 8,192 table columns but no 8,192 blocks, since a table may name a
block many times. The compile key of a call depends on the table's width, never on which blocks it names
(``certvllm.triton_kernels.shape_class``), so such calls compile exactly what serving compiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from certvllm.attention.op import certified_attention
from certvllm.bounds.report import CertifiedOutput
from certvllm.config import CertConfig
from certvllm.formats.layout import BLOCK_SIZE, PageLayout
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.cuda_pagein import CudaPageInEngine, write_tokens_on_device
from certvllm.kv.prefetch import StepPrefetcher
from certvllm.kv.promotion_cache import PromotionCache
from certvllm.kv.residency import Residency, pool_values
from certvllm.triton_kernels.tuning import parse_tuning


def engine_sub_blocks(block_size_tokens: int) -> int:
    """16-token blocks per engine block (``m``); raises unless the engine block is a multiple of 16 tokens."""
    if block_size_tokens < BLOCK_SIZE or block_size_tokens % BLOCK_SIZE:
        raise ValueError(f"block_size_tokens={block_size_tokens}: the engine block must be a multiple of {BLOCK_SIZE}")
    return block_size_tokens // BLOCK_SIZE


def table_width(max_len: int, block_size_tokens: int) -> int:
    """Block-table columns (16-token ids) of a batch whose longest row has ``max_len`` tokens: the engine blocks
    it needs times ``m`` (what the vLLM metadata builder cuts the table to)."""
    m = engine_sub_blocks(block_size_tokens)
    return max(1, -(-int(max_len) // block_size_tokens)) * m


class SyntheticLayer:
    """One layer's cache of ``blocks`` 16-token blocks on ``device`` (rounded up to whole engine blocks), filled
    with random keys and values through the CUDA write path (device stores into the shadow, then the Triton
    write kernel), with the residency the vLLM worker gives each layer (``WorkerRuntime._residency``: a
    promotion pool when ``promotion_cache_fraction`` > 0 and, with it, one step prefetcher shared by the
    ``layers`` layers when the step prefetch runs). All layers share the one cache.

    Runs on a CUDA device, or on the CPU under Triton's interpreter (tests).

    Args:
        num_q_heads, num_kv_heads, head_dim, dtype: the model's attention shape and KV dtype.
        config: the server's config (value group, mode, pool and prefetch fractions).
        device: where the pages live.
        block_size_tokens: the engine's block size (a multiple of 16).
        page_token_bytes: bytes per token of the page (``PageLayout.token_bytes``); None: ``2·head_dim``, the
            vLLM certified page (``vllm_plugin.host_tier.vllm_page_layout``); 0: the smallest page.
        blocks: 16-token blocks of the cache.
        layers: layers that take part in the step prefetch (each with its own pool).
        scale: the softmax scale of the calls (None: ``1/√D``).
        seed: seed of the keys, values and queries.
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        config: CertConfig,
        device: torch.device | str,
        *,
        block_size_tokens: int = 16,
        page_token_bytes: int | None = None,
        blocks: int = 64,
        layers: int = 1,
        scale: float | None = None,
        seed: int = 0,
    ) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"H_q={num_q_heads} is not a multiple of H_kv={num_kv_heads}")
        self.num_q_heads, self.dtype, self.config = num_q_heads, dtype, config
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.device = torch.device(device)
        self.block_size_tokens = block_size_tokens
        m = engine_sub_blocks(block_size_tokens)
        token_bytes = 2 * head_dim if page_token_bytes is None else page_token_bytes
        key_levels, value_levels = config.code_levels
        layout = PageLayout(head_dim, config.value_group_size, token_bytes=token_bytes, key_levels=key_levels,
                            value_levels=value_levels)  # fmt: skip
        engine_blocks = max(1, math.ceil(blocks / m))
        pages = torch.zeros(engine_blocks, num_kv_heads, m * layout.page_bytes, dtype=torch.uint8, device=self.device)
        shadow = torch.zeros(engine_blocks, num_kv_heads, 2, m * BLOCK_SIZE, head_dim, dtype=dtype)  # host tier
        self.cache = LayerKVCache(pages, shadow, layout)
        self.gen = torch.Generator().manual_seed(seed)
        self.generator = torch.Generator().manual_seed(config.seed)  # exploration draws, as the vLLM impl's
        self.pagein = CudaPageInEngine(self.device)
        self._prefetcher: StepPrefetcher | None = None
        self.residencies = [self._residency() for _ in range(layers)]
        self._fill()

    @property
    def prefetcher(self) -> StepPrefetcher | None:
        """The layers' step prefetcher, or None."""
        return self._prefetcher

    def _residency(self) -> Residency:
        """The next layer's residency (its pool; its entry in the shared prefetcher, made on first use)."""
        cfg = self.config
        if cfg.promotion_cache_fraction <= 0:
            return Residency()
        res = Residency.for_layer(self.cache, cfg.promotion_cache_fraction, pool_values(cfg.decode_pass))
        if cfg.step_prefetch_fraction > 0:
            if self._prefetcher is None:
                self._prefetcher = StepPrefetcher.for_cache(self.cache, cfg.step_prefetch_fraction,
                                                            tuning=parse_tuning(cfg.kernel_tuning))  # fmt: skip
            res.prefetcher, res.prefetch_index = self._prefetcher, self._prefetcher.register(self.cache)
        return res

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def _fill(self) -> None:
        """Every block full of random keys and values, written as the vLLM backend's CUDA write path does. Where the
        config gives the two-pass path a pool, the first half is written plain and the second through a
        write-through pool (``PromotionCache.write_through``: one slot per page, kept as :attr:`direct`, else
        None), so that both variants of the write kernel are compiled whichever pool the server's layers get."""
        cache = self.cache
        tokens = cache.num_blocks * BLOCK_SIZE
        k = self._randn(tokens, cache.num_kv_heads, cache.layout.head_dim).to(self.device)
        v = self._randn(tokens, cache.num_kv_heads, cache.layout.head_dim).to(self.device)
        slots = torch.arange(tokens, device=self.device)
        cfg = self.config
        self.direct: Residency | None = None
        if cfg.promotion_cache_fraction > 0 and not pool_values(cfg.decode_pass):
            self.direct = Residency(pool=PromotionCache(cache, cache.num_blocks * cache.num_kv_heads))
        if self.direct is None:
            write_tokens_on_device(cache, k, v, slots)
            return
        half = max(1, cache.num_blocks // 2) * BLOCK_SIZE
        write_tokens_on_device(cache, k[:half], v[:half], slots[:half])
        write_tokens_on_device(cache, k[half:], v[half:], slots[half:], self.direct.pool)

    def tables(self, rows: int, width: int) -> torch.Tensor:
        """``[rows, width]`` int64 block ids on the device: every row walks the cache's blocks from its own
        offset, wrapping around (ids repeat)."""
        cols = torch.arange(width, dtype=torch.int64)
        start = torch.arange(rows, dtype=torch.int64).unsqueeze(1) * 7
        return ((cols.unsqueeze(0) + start) % self.cache.num_blocks).to(self.device)

    def call(self, lens: Sequence[int], layer: int = 0, *, begin_step: bool = False,
             write_through: bool = False) -> CertifiedOutput:  # fmt: skip
        """One certified decode call of ``len(lens)`` rows with these context lengths, through the public op
        as the vLLM backend makes it (its table cut to the longest row, rungs 3/4 on the device, the layer's
        residency). ``begin_step``: first start the step prefetch's stagings, as the metadata builder does
        once per step. ``write_through``: with :attr:`direct`'s write-through pool instead of the layer's (the
        pool a server gets when its host tier caps the cache; there must be one)."""
        if begin_step and self.prefetcher is not None:
            self.prefetcher.begin_step()
        return self._op(*self._inputs(lens), layer, None, self.direct if write_through else None)

    def gather_cached_context(self) -> torch.Tensor:
        """The exact prefill's gather of a cached context's originals (``attention.dense.gather_row_kv``) through
        :attr:`direct`'s write-through pool, as the vLLM backend makes it where its layers have one (keys from the
        pool where current, the rest from the shadow): compiles that variant of the gather. Needs :attr:`direct`."""
        if self.direct is None:
            raise ValueError("gather_cached_context needs the write-through pool of a config with a two-pass pool")
        ids = torch.arange(self.cache.num_blocks, device=self.device)
        return self.pagein.gather_blocks(self.cache, ids, self.direct.pool.direct_keys())

    def audited_call(self, lens: Sequence[int]) -> int:
        """:meth:`call` with every head-step audited (``certvllm.attention.audit`` at rate 1: on CUDA the device
        checks, ``triton_kernels.audit_check``), the checks read back; returns the violations (0 on these pages)."""
        from certvllm.attention.audit import Auditor

        q, tables, seq_lens = self._inputs(lens)
        auditor = Auditor(self.config.model_copy(update={"audit_rate": 1.0, "audit_policy": "log"}))
        auditor.device_reference = True  # the CUDA path's checks, as the calls (the interpreter on the CPU)
        auditor.run(
            0, q, self.cache, tables, seq_lens, self.scale, lambda force: self._op(q, tables, seq_lens, 0, force, None)
        )
        auditor.resolve(wait=True)
        return auditor.violations

    def _inputs(self, lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [R, H_q, D], tables [R, W] int64, lens [R] int64)`` of a call: the table cut to the longest row."""
        seq_lens = torch.tensor([int(n) for n in lens], dtype=torch.int64)
        tables = self.tables(len(lens), table_width(int(seq_lens.max()), self.block_size_tokens))
        q = self._randn(len(lens), self.num_q_heads, self.cache.layout.head_dim).to(self.device)
        return q, tables, seq_lens

    def _op(self, q: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor, layer: int,
            force_exact: torch.Tensor | None, residency: Residency | None) -> CertifiedOutput:  # fmt: skip
        residency = self.residencies[layer] if residency is None else residency
        return certified_attention(q, self.cache, tables, seq_lens, self.config, self.scale, pagein=self.pagein,
                                   generator=self.generator, residency=residency, backend="cuda",
                                   force_exact=force_exact)  # fmt: skip
