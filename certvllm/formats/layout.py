"""Byte layout of one tier-1 page: one 16-token KV block of one KV head.

A page holds the quantized keys and values of a *full* block (``N = 16`` tokens), written
once when the block's last token arrives and never updated afterwards (precondition P1).
A block that is not yet full has no valid page: its tokens are read unquantized from the
tier-2 shadow page (see ``certvllm.kv``).

With ``D`` = head dim, ``g`` = value group size (16), ``G = D / g`` groups per token::

    offset                      size (bytes)   content
    0                           N*D            K codes      uint8  [N, D]   k̂ = ℓ_c + code·σ_c
    N*D                         N*D/2          V codes      uint8  [N, D/2] two INT4 codes per byte,
                                                                            even element in the low nibble
    3N*D/2                      2*N*G          V scale      fp16   [N, G]   per token, per group
    3N*D/2 + 2NG                2*N*G          V zero       fp16   [N, G]   v̂ = zero + code·scale
    3N*D/2 + 4NG                2*D            K offset ℓ   fp16   [D]      per channel, ≤ block min
    3N*D/2 + 4NG + 2D           D              K scale code uint8  [D]      σ_c = LUT[code]·2^E (0 → σ=0)
    3N*D/2 + 4NG + 3D           16             header:
                                                 +0  η   fp32  max_t ‖V̂_t − V_t‖₂ (absolute, rounded up)
                                                 +4  ν   fp32  max_t ‖V_t‖₂        (rounded up)
                                                 +8  E   int8  block scale exponent of σ
                                                 +9  flags uint8 (bit0 VALID, bit1 PRECONDITION_VIOLATED)
                                                 +10 6 bytes reserved (zero)
    ...                         padding to N*C bytes, C = bytes per token (multiple of 16)

At D = 128: 2048 + 1024 + 256 + 256 + 256 + 128 + 16 = 3984 bytes → C = 256 bytes per token per
KV head, all metadata included (FP16 K+V is 512: exactly half). At D = 64: 2000 → C = 128.

The key scale is a log-coded byte: σ = 2^(E + (code − 255)/32), a 2.2 % grid, rounded *up* so
that ``ℓ + 255·σ ≥ max`` and no code ever saturates (precondition P2: |k − k̂| ≤ σ/2).

``key_levels``/``value_levels`` (default 255 and 15) are the largest codes the encoder uses: fewer levels in the same
bytes are a *stress format* for the evaluation's stress study (``CertConfig.key_code_levels``, ``value_code_levels``),
coarser by construction; P2 and η hold for them unchanged (σ covers the range in ``key_levels`` steps, η is the
measured error), so the certificate stays sound on them. Never a production setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

BLOCK_SIZE = 16
"""Tokens per KV block: the unit of quantization, selection and page-in."""

HEADER_BYTES = 16
FLAG_VALID = 1
FLAG_PRECONDITION = 2

KEY_CODE_MAX = 255
VALUE_CODE_MAX = 15
CODE_LEVELS = (KEY_CODE_MAX, VALUE_CODE_MAX)
"""The product format's largest key and value codes (``PageLayout.key_levels``, ``value_levels``)."""
SCALE_LUT_STEPS_PER_OCTAVE = 32


@dataclass(frozen=True)
class PageLayout:
    """Offsets of every field inside one ``[N * C]`` byte page.

    Args:
        head_dim: D, a multiple of ``value_group`` (and even), at most 256.
        value_group: g, elements per INT4 value group.
        block_size: N, tokens per block (16).
        token_bytes: C when a larger page than the smallest is wanted (an engine's fixed page size); 0 for
            the smallest multiple of 16 that holds the fields.
        key_levels, value_levels: the largest key and value codes the encoder uses (255 and 15; fewer only for
            the stress study's formats, module docstring).
    """

    head_dim: int
    value_group: int = 16
    block_size: int = BLOCK_SIZE
    token_bytes: int = 0
    key_levels: int = KEY_CODE_MAX
    value_levels: int = VALUE_CODE_MAX

    def __post_init__(self) -> None:
        d, g = self.head_dim, self.value_group
        if not (1 <= self.key_levels <= KEY_CODE_MAX and 1 <= self.value_levels <= VALUE_CODE_MAX):
            raise ValueError(
                f"key_levels={self.key_levels}, value_levels={self.value_levels}: the largest key code must be in "
                f"[1, {KEY_CODE_MAX}] and the largest value code in [1, {VALUE_CODE_MAX}] (the page's INT8/INT4 fields)"
            )
        if d <= 0 or d > 256 or d % g != 0 or d % 2 != 0:
            raise ValueError(
                f"head_dim={d} is not supported: it must be even, a multiple of the value group "
                f"size {g}, and at most 256 (FP32 accumulators, precondition P3). Use a model whose "
                "head size fits, or serve it with --kv-cache-dtype auto."
            )
        if self.token_bytes and (self.token_bytes % 16 or self.token_bytes * self.block_size < self.used_bytes):
            raise ValueError(
                f"token_bytes={self.token_bytes}: a page of D={d}, g={g} needs a multiple of 16 of at least "
                f"{self.smallest_token_bytes} bytes per token; use a smaller value group or a larger page"
            )

    @property
    def groups(self) -> int:
        return self.head_dim // self.value_group

    @cached_property
    def k_codes(self) -> int:
        return 0

    @cached_property
    def v_codes(self) -> int:
        return self.block_size * self.head_dim

    @cached_property
    def v_scale(self) -> int:
        return self.v_codes + self.block_size * self.head_dim // 2

    @cached_property
    def v_zero(self) -> int:
        return self.v_scale + 2 * self.block_size * self.groups

    @cached_property
    def k_offset(self) -> int:
        return self.v_zero + 2 * self.block_size * self.groups

    @cached_property
    def k_scale_code(self) -> int:
        return self.k_offset + 2 * self.head_dim

    @cached_property
    def header(self) -> int:
        return self.k_scale_code + self.head_dim

    @cached_property
    def used_bytes(self) -> int:
        return self.header + HEADER_BYTES

    @cached_property
    def smallest_token_bytes(self) -> int:
        """The fields' bytes per token, rounded up to a multiple of 16."""
        per_token = -(-self.used_bytes // self.block_size)
        return -(-per_token // 16) * 16

    @cached_property
    def bytes_per_token(self) -> int:
        """C: page bytes per token (``token_bytes``, or the smallest)."""
        return self.token_bytes or self.smallest_token_bytes

    @cached_property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    def fp16_bytes_per_token(self) -> int:
        """Bytes per token per KV head of the unquantized K+V in a 16-bit dtype."""
        return 4 * self.head_dim


def key_scale_lut() -> torch.Tensor:
    """The 256-entry float32 table of σ mantissas: ``LUT[0] = 0``, ``LUT[c] = 2^((c − 255)/32)``.

    Computed once in float64 on the CPU and rounded to float32, so every device uses bit-identical
    scales (σ = LUT[c]·2^E is then exact in float32).
    """
    codes = torch.arange(256, dtype=torch.float64)
    lut = torch.exp2((codes - KEY_CODE_MAX) / SCALE_LUT_STEPS_PER_OCTAVE).to(torch.float32)
    lut[0] = 0.0
    return lut
