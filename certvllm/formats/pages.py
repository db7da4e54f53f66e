"""Encode full blocks into tier-1 pages and read typed fields back (layout in ``layout.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certvllm.formats.keys import dequantize_keys, key_magnitude, key_sigma, quantize_keys
from certvllm.formats.layout import FLAG_PRECONDITION, FLAG_VALID, PageLayout, key_scale_lut
from certvllm.formats.values import dequantize_values, quantize_values


def _field(pages: torch.Tensor, start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A typed view ``[..., nbytes / itemsize]`` of the byte range of every page."""
    return pages[..., start : start + nbytes].view(dtype)


def encode_pages(k: torch.Tensor, v: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """Quantize full blocks into pages.

    Args:
        k, v: ``[..., N, D]`` float16/bfloat16 keys and values (post-RoPE keys).
        layout: the page layout for ``D``.

    Returns:
        ``[..., page_bytes]`` uint8 pages, zero padded.
    """
    lead = k.shape[:-2]
    n, d, g = layout.block_size, layout.head_dim, layout.groups
    qk = quantize_keys(k, layout.key_levels)
    qv = quantize_values(v, layout.value_group, layout.value_levels)
    pages = torch.zeros(*lead, layout.page_bytes, dtype=torch.uint8, device=k.device)
    _field(pages, layout.k_codes, n * d, torch.uint8).copy_(qk.codes.flatten(-2))
    _field(pages, layout.v_codes, n * d // 2, torch.uint8).copy_(qv.codes.flatten(-2))
    _field(pages, layout.v_scale, 2 * n * g, torch.float16).copy_(qv.scale.flatten(-2))
    _field(pages, layout.v_zero, 2 * n * g, torch.float16).copy_(qv.zero.flatten(-2))
    _field(pages, layout.k_offset, 2 * d, torch.float16).copy_(qk.offset)
    _field(pages, layout.k_scale_code, d, torch.uint8).copy_(qk.scale_code)
    header = pages[..., layout.header : layout.header + 16]
    header[..., 0:8].view(torch.float32).copy_(torch.stack((qv.eta, qv.nu), dim=-1))
    header[..., 8].copy_(qk.exponent.view(torch.uint8))
    flags = torch.full(lead, FLAG_VALID, dtype=torch.uint8, device=k.device)
    flags |= (qk.violated | qv.violated).to(torch.uint8) * FLAG_PRECONDITION
    header[..., 9].copy_(flags)
    return pages


@dataclass
class DecodedPages:
    """Everything the read path needs from a batch of pages (``...`` = leading batch shape).

    Attributes:
        keys: ``[..., N, D]`` float32 k̂.
        sigma: ``[..., D]`` float32 key scales σ.
        key_mag: ``[..., D]`` float32 M + σ, a bound on |k| and |k̂| per channel.
        values: ``[..., N, D]`` float32 v̂ (only when requested).
        eta, nu: ``[...]`` float32 annotations.
        valid: ``[...]`` bool, page was written for a full block.
        violated: ``[...]`` bool, a precondition was flagged when the page was written.
    """

    keys: torch.Tensor
    sigma: torch.Tensor
    key_mag: torch.Tensor
    values: torch.Tensor | None
    eta: torch.Tensor
    nu: torch.Tensor
    valid: torch.Tensor
    violated: torch.Tensor


class PageReader:
    """Decodes pages of one layout; holds the σ lookup table per device."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self._lut: dict[torch.device, torch.Tensor] = {}

    def lut(self, device: torch.device) -> torch.Tensor:
        if device not in self._lut:
            self._lut[device] = key_scale_lut().to(device)
        return self._lut[device]

    def decode(self, pages: torch.Tensor, with_values: bool = True) -> DecodedPages:
        """Decode pages ``[..., page_bytes]`` uint8 (contiguous in the last dim)."""
        lay = self.layout
        n, d, g = lay.block_size, lay.head_dim, lay.groups
        header = pages[..., lay.header : lay.header + 16]
        exponent = header[..., 8].view(torch.int8)
        flags = header[..., 9]
        ann = header[..., 0:8].view(torch.float32)
        sigma = key_sigma(_field(pages, lay.k_scale_code, d, torch.uint8), exponent, self.lut(pages.device))
        offset = _field(pages, lay.k_offset, 2 * d, torch.float16)
        codes = _field(pages, lay.k_codes, n * d, torch.uint8).unflatten(-1, (n, d))
        values = None
        if with_values:
            values = dequantize_values(
                _field(pages, lay.v_codes, n * d // 2, torch.uint8).unflatten(-1, (n, d // 2)),
                _field(pages, lay.v_scale, 2 * n * g, torch.float16).unflatten(-1, (n, g)),
                _field(pages, lay.v_zero, 2 * n * g, torch.float16).unflatten(-1, (n, g)),
            )
        return DecodedPages(
            keys=dequantize_keys(codes, offset, sigma),
            sigma=sigma,
            key_mag=key_magnitude(offset, sigma),
            values=values,
            eta=ann[..., 0],
            nu=ann[..., 1],
            valid=(flags & FLAG_VALID) != 0,
            violated=(flags & FLAG_PRECONDITION) != 0,
        )
