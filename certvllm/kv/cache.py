"""Tiered KV storage of one attention layer: tier-1 pages and tier-2 shadow pages, by block id.

Tier 1 (device): ``pages`` ``[num_blocks, H_kv, page_bytes]`` uint8, one page per (block, KV head),
byte layout in ``certvllm.formats.layout``. vLLM's ``[num_blocks, H_kv, N, C]`` uint8 KV tensor
is this tensor viewed with the last two dims merged.

Tier 2 (host): ``shadow`` ``[num_blocks, H_kv, 2, N, D]`` in the model's KV dtype (float16 or
bfloat16): index 0 holds keys, 1 values; ``shadow[b, h, 0]`` (one block's keys of one head) is one
contiguous ``N·D·2``-byte run, the unit of a page-in. The shadow holds exactly what an
unquantized cache would hold. With ``keys_channel_major`` the key half of each (block, head) run is
stored transposed, ``[D, N]``, which is how vLLM's CPU attention kernel lays out its key cache: the
shadow is then a valid CPU KV cache and exact fallbacks run vLLM's own kernel on it.

Write rule: every token is written to the shadow at its slot; when a write lands on the last
slot of a block (offset N − 1) the block is full and its page is encoded from the shadow. A
block's page is therefore valid exactly when the block is full, and it is rewritten whenever a
reused block fills again.
"""

from __future__ import annotations

import torch

from certvllm.formats.layout import BLOCK_SIZE, PageLayout
from certvllm.formats.pages import encode_pages

SUPPORTED_KV_DTYPES = (torch.float16, torch.bfloat16)


class LayerKVCache:
    """Tier-1 pages and tier-2 shadow of one layer.

    Args:
        pages: ``[num_blocks, H_kv, page_bytes]`` uint8 (device tier).
        shadow: ``[num_blocks, H_kv, 2, N, D]`` float16/bfloat16 (host tier).
        layout: page layout for ``D``.
    """

    def __init__(
        self, pages: torch.Tensor, shadow: torch.Tensor, layout: PageLayout, keys_channel_major: bool = False
    ) -> None:
        num_blocks, heads, page_bytes = pages.shape
        if pages.dtype != torch.uint8 or page_bytes != layout.page_bytes:
            raise ValueError(
                f"Invalid pages: expected uint8 [num_blocks, H_kv, {layout.page_bytes}], got "
                f"{pages.dtype} {list(pages.shape)}"
            )
        expected = (num_blocks, heads, 2, layout.block_size, layout.head_dim)
        if tuple(shadow.shape) != expected or shadow.dtype not in SUPPORTED_KV_DTYPES:
            raise ValueError(
                f"Invalid shadow: expected float16/bfloat16 {list(expected)}, got {shadow.dtype} {list(shadow.shape)}"
            )
        self.pages = pages
        self.shadow = shadow
        self.layout = layout
        self.keys_channel_major = keys_channel_major

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        value_group: int = 16,
    ) -> LayerKVCache:
        """Allocate zeroed pages on ``device`` and a zeroed shadow in host memory."""
        if dtype not in SUPPORTED_KV_DTYPES:
            raise ValueError(f"KV dtype {dtype} is not supported; originals must be float16 or bfloat16")
        layout = PageLayout(head_dim, value_group)
        pages = torch.zeros(num_blocks, num_kv_heads, layout.page_bytes, dtype=torch.uint8, device=device)
        shadow = torch.zeros(num_blocks, num_kv_heads, 2, BLOCK_SIZE, head_dim, dtype=dtype)
        return cls(pages, shadow, layout)

    def split(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[..., N, D]`` of shadow pages ``[..., 2, N, D]`` (any leading shape)."""
        keys = blocks[..., 0, :, :]
        if self.keys_channel_major:
            n, d = self.layout.block_size, self.layout.head_dim
            keys = keys.reshape(*keys.shape[:-2], d, n).transpose(-1, -2)  # gathered copies: reshape is fine
        return keys, blocks[..., 1, :, :]

    def _shadow_keys(self) -> torch.Tensor:
        """A writable view of the key half: ``[num_blocks, H_kv, N, D]`` indexed by (block, head, offset)."""
        keys = self.shadow[:, :, 0]
        if self.keys_channel_major:
            nb, h, n, d = keys.shape
            return keys.view(nb, h, d, n).transpose(-1, -2)  # a view: writes reach the shadow
        return keys

    @property
    def num_blocks(self) -> int:
        return self.pages.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.pages.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.shadow.dtype

    def write(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Store new tokens and quantize every block they complete.

        Args:
            key, value: ``[n, H_kv, D]`` in the shadow's dtype (keys after RoPE).
            slots: ``[n]`` int, ``block_id·N + offset``; negative slots are padding and skipped.

        Returns:
            ``[m]`` int64 ids of the blocks whose pages were (re)encoded.
        """
        if key.dtype != self.shadow.dtype or value.dtype != self.shadow.dtype:
            raise ValueError(
                f"KV dtype mismatch: cache holds {self.shadow.dtype}, got keys {key.dtype} / values {value.dtype}"
            )
        n = self.layout.block_size
        slots = slots.to(device=self.shadow.device, dtype=torch.int64)
        keep = slots >= 0
        slots = slots[keep]
        block, offset = slots // n, slots % n
        keys = self._shadow_keys()
        keys[block, :, offset] = key[keep.to(key.device)].to(self.shadow.device)
        self.shadow[block, :, 1, offset] = value[keep.to(value.device)].to(self.shadow.device)
        full = torch.unique(block[offset == n - 1])
        if full.numel():
            k, v = self.split(self.shadow[full].to(self.pages.device))
            self.pages[full.to(self.pages.device)] = encode_pages(k, v, self.layout)
        return full

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks (pages and shadows), e.g. copy-on-write of a shared prefix block."""
        src_h, dst_h = src.to(self.shadow.device), dst.to(self.shadow.device)
        self.shadow[dst_h] = self.shadow[src_h]
        self.pages[dst.to(self.pages.device)] = self.pages[src.to(self.pages.device)]
