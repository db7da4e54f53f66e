"""Tiered KV storage of one attention layer: tier-1 pages and tier-2 shadow pages, by block id.

Blocks are 16 tokens (``N``): the unit of quantization, selection and page-in. An engine may group
``m`` of them into one *engine block* of ``m·N`` tokens (vLLM on the CPU uses 128-token blocks); block
ids here are always 16-token ids, ``engine_block·m + sub`` — token slots are the same in both numberings.

Tier 1 (device): ``pages`` ``[num_engine_blocks, H_kv, m·page_bytes]`` uint8; the page of (block, head)
is the ``sub``-th ``page_bytes`` run of ``pages[engine_block, head]``, byte layout in
``certvllm.formats.layout``. vLLM's ``[num_blocks, H_kv, m·N, C]`` uint8 tensor is this tensor viewed.

Tier 2 (host): ``shadow`` ``[num_engine_blocks, H_kv, 2, m·N, D]`` in the model's KV dtype (float16,
bfloat16 or float32), index 0 keys and 1 values: exactly what an unquantized cache holds. With
``keys_channel_major`` the key half of each (engine block, head) is stored transposed, ``[D, m·N]``,
as vLLM's CPU attention kernel stores its key cache: the shadow is then a valid vLLM CPU KV cache and
exact attention runs vLLM's own kernel on it.

Write rule: every token is written to the shadow at its slot; when a write lands on the last slot of
a 16-token block the block is full and its page is encoded from the shadow. A page is therefore valid
exactly when its block is full, and it is rewritten whenever a reused block fills again.

Write generations: once :meth:`LayerKVCache.enable_generations` has been called (the CUDA promotion cache
does, ``certvllm.kv.promotion_cache``), ``generation`` ``[num_blocks]`` int64 on the pages' device counts
writes per 16-token block: every method here that writes a block's shadow or page adds 1 to it (a device
op, ordered on the current stream, no synchronisation), and so does the CUDA write path
(``cuda_pagein.encode_blocks_from_shadow``). Counters only grow, so a copy tagged with an older value can
never match again. Code that writes ``shadow`` or ``pages`` directly must call :meth:`bump_generation`.
"""

from __future__ import annotations

import torch

from certvllm.formats.layout import BLOCK_SIZE, CODE_LEVELS, PageLayout
from certvllm.formats.pages import encode_pages

SUPPORTED_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float32: CPUs without native bf16


class LayerKVCache:
    """Tier-1 pages and tier-2 shadow of one layer.

    Args:
        pages: ``[num_engine_blocks, H_kv, m·page_bytes]`` uint8 (device tier).
        shadow: ``[num_engine_blocks, H_kv, 2, m·N, D]`` float16/bfloat16 (host tier).
        layout: page layout for ``D``.
        keys_channel_major: keys stored ``[D, m·N]`` per (engine block, head).
    """

    def __init__(
        self, pages: torch.Tensor, shadow: torch.Tensor, layout: PageLayout, keys_channel_major: bool = False
    ) -> None:
        engine_blocks, heads, page_run = pages.shape
        n, d = layout.block_size, layout.head_dim
        if shadow.dim() != 5 or shadow.shape[3] % n != 0:
            raise ValueError(f"Invalid shadow: expected [blocks, H_kv, 2, m·{n}, {d}], got {list(shadow.shape)}")
        self.sub_blocks = shadow.shape[3] // n
        if pages.dtype != torch.uint8 or page_run != self.sub_blocks * layout.page_bytes:
            raise ValueError(
                f"Invalid pages: expected uint8 [blocks, H_kv, {self.sub_blocks * layout.page_bytes}], got "
                f"{pages.dtype} {list(pages.shape)}"
            )
        expected = (engine_blocks, heads, 2, self.sub_blocks * n, d)
        if tuple(shadow.shape) != expected or shadow.dtype not in SUPPORTED_KV_DTYPES:
            raise ValueError(
                f"Invalid shadow: expected float16/bfloat16/float32 {list(expected)}, "
                f"got {shadow.dtype} {list(shadow.shape)}"
            )
        self.pages = pages
        self.shadow = shadow
        self.layout = layout
        self.keys_channel_major = keys_channel_major
        self.generation: torch.Tensor | None = None  # [num_blocks] int64 write counters (enable_generations)

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        value_group: int = 16,
        code_levels: tuple[int, int] = CODE_LEVELS,
    ) -> LayerKVCache:
        """Allocate zeroed pages for ``num_blocks`` 16-token blocks on ``device`` and a zeroed host shadow
        (``code_levels``: the largest key and value codes, ``PageLayout.key_levels``/``value_levels``)."""
        if dtype not in SUPPORTED_KV_DTYPES:
            raise ValueError(f"KV dtype {dtype} is not supported; originals must be float16, bfloat16 or float32")
        layout = PageLayout(head_dim, value_group, key_levels=code_levels[0], value_levels=code_levels[1])
        pages = torch.zeros(num_blocks, num_kv_heads, layout.page_bytes, dtype=torch.uint8, device=device)
        shadow = torch.zeros(num_blocks, num_kv_heads, 2, BLOCK_SIZE, head_dim, dtype=dtype)
        return cls(pages, shadow, layout)

    @property
    def num_blocks(self) -> int:
        """Number of 16-token blocks."""
        return self.pages.shape[0] * self.sub_blocks

    @property
    def num_kv_heads(self) -> int:
        return self.pages.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.shadow.dtype

    # -- write generations -------------------------------------------------------------------------
    def enable_generations(self) -> torch.Tensor:
        """Start counting writes per block (idempotent); returns the ``[num_blocks]`` int64 counters on the
        pages' device. Copies of blocks taken before this call must not be trusted (none exist: the only
        consumer, the promotion cache, enables the counters when it is created empty)."""
        if self.generation is None:
            self.generation = torch.zeros(self.num_blocks, dtype=torch.int64, device=self.pages.device)
        return self.generation

    def bump_generation(self, block_ids: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Record a write to the shadow or page of 16-token blocks ``block_ids`` (any shape, any device):
        adds ``counts`` (same shape; default 1 each, 0 for an id that was not written) to their counters, on the
        device, without synchronising. No-op until generations are on."""
        if self.generation is None:
            return
        ids = block_ids.reshape(-1).to(self.generation.device, torch.int64, non_blocking=True)
        add = torch.ones_like(ids) if counts is None else counts.reshape(-1).to(ids.device, torch.int64)
        self.generation.index_add_(0, ids, add)

    # -- tier 1 ----------------------------------------------------------------------------------
    def _page_view(self) -> torch.Tensor:
        e, h, _ = self.pages.shape
        return self.pages.view(e, h, self.sub_blocks, self.layout.page_bytes)

    def read_pages(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Pages of blocks ``[...]`` → ``[..., H_kv, page_bytes]`` uint8 (a gathered copy)."""
        ids = block_ids.to(self.pages.device)
        m = self.sub_blocks
        return self._page_view()[ids // m, :, ids % m]

    def write_pages(self, block_ids: torch.Tensor, pages: torch.Tensor) -> None:
        ids = block_ids.to(self.pages.device)
        m = self.sub_blocks
        self._page_view()[ids // m, :, ids % m] = pages
        self.bump_generation(ids)

    # -- tier 2 ----------------------------------------------------------------------------------
    def _shadow_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views ``[E, H, m, N, D]`` of keys (possibly strided) and values."""
        e, h, _, _, d = self.shadow.shape
        m, n = self.sub_blocks, self.layout.block_size
        keys = self.shadow[:, :, 0]
        if self.keys_channel_major:
            keys = keys.view(e, h, d, m, n).permute(0, 1, 3, 4, 2)
        else:
            keys = keys.view(e, h, m, n, d)
        return keys, self.shadow[:, :, 1].view(e, h, m, n, d)

    def shadow_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Originals of whole blocks: ``[n, H_kv, 2, N, D]`` token-major (a gathered copy, host)."""
        ids = block_ids.to(self.shadow.device)
        keys, values = self._shadow_views()
        m = self.sub_blocks
        return torch.stack((keys[ids // m, :, ids % m], values[ids // m, :, ids % m]), dim=2)

    def shadow_pages(self, block_ids: torch.Tensor, kv_heads: torch.Tensor) -> torch.Tensor:
        """Originals of single (block, KV head) pages: ``[n, 2, N, D]`` token-major (host)."""
        ids = block_ids.to(self.shadow.device)
        heads = kv_heads.to(self.shadow.device)
        keys, values = self._shadow_views()
        m = self.sub_blocks
        return torch.stack((keys[ids // m, heads, ids % m], values[ids // m, heads, ids % m]), dim=1)

    # -- write path --------------------------------------------------------------------------------
    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Store new tokens and quantize every block they complete.

        Args:
            key, value: ``[n, H_kv, D]`` in the shadow's dtype (keys after RoPE).
            slots: ``[n]`` int, ``block_id·N + offset``; negative slots are padding and skipped.

        Returns:
            ``[k]`` int64 ids of the blocks whose pages were (re)encoded.
        """
        if key.dtype != self.shadow.dtype or value.dtype != self.shadow.dtype:
            raise ValueError(
                f"KV dtype mismatch: cache holds {self.shadow.dtype}, got keys {key.dtype} / values {value.dtype}"
            )
        self.write_shadow(key, value, slots)
        return self.encode_completed(slots)

    def write_shadow(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Write tokens into the shadow only; returns the ``[k]`` int64 ids of the blocks they complete
        (the caller encodes their pages, e.g. with a device kernel)."""
        n, m = self.layout.block_size, self.sub_blocks
        slots = slots.to(device=self.shadow.device, dtype=torch.int64)
        keep = slots >= 0
        live = slots[keep]
        block, offset = live // n, live % n
        keys, values = self._shadow_views()
        keys[block // m, :, block % m, offset] = key[keep.to(key.device)].to(self.shadow.device)
        values[block // m, :, block % m, offset] = value[keep.to(value.device)].to(self.shadow.device)
        self.bump_generation(block)
        return torch.unique(block[offset == n - 1])

    def encode_completed(self, slots: torch.Tensor) -> torch.Tensor:
        """Encode the pages of every block whose last slot is among ``slots`` (the shadow must
        already hold the block's tokens). Returns the ``[k]`` int64 ids of the encoded blocks.

        An engine with its own fast shadow writer calls this after writing the shadow itself.
        """
        n = self.layout.block_size
        slots = slots.to(device="cpu", dtype=torch.int64)
        last = slots[(slots >= 0) & (slots % n == n - 1)]
        full = torch.unique(last // n)
        if full.numel():
            src = self.shadow_blocks(full).to(self.pages.device)
            self.write_pages(full, encode_pages(src[:, :, 0], src[:, :, 1], self.layout))
        return full

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole 16-token blocks (pages and shadows), e.g. copy-on-write of a shared prefix block."""
        keys, values = self._shadow_views()
        m = self.sub_blocks
        s, d = src.to(self.shadow.device), dst.to(self.shadow.device)
        keys[d // m, :, d % m] = keys[s // m, :, s % m]
        values[d // m, :, d % m] = values[s // m, :, s % m]
        self.write_pages(dst, self.read_pages(src))  # bumps the generation of dst
