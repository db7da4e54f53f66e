"""The compile class of a layer call: what a launcher derives from the call's shape that enters a kernel's
compile key.

Triton compiles one variant per distinct key: every constexpr, every compile option (``num_warps`` …), the
dtypes of the arguments and, unless a kernel opts out, a value class of each plain int argument (equal to 1,
divisible by 16, other) and the 16-byte alignment of each pointer. The kernels opt out for every int that
follows the call or the cache and for the pointers a caller may pass as views (``RUNTIME_INTS``,
``CALLER_POINTERS`` below, passed to ``do_not_specialize`` / ``do_not_specialize_on_alignment``). What is
left of the key, once the model's head layout, the page layout, the config and the tuning are fixed, is a
function of the block-table width ``B`` alone, and only through :func:`width_class`:

* ``bp``: the next power of two ≥ B, the ``BP`` of the glue kernels (``prepare``, ``select``, ``finalize``;
  also ``select``'s ``LOG2BP`` and warps), or 0 past ``GLUE_MAX_BLOCKS``, where the glue runs as torch code;
* ``item_block``: the ``BLK`` of the per-(row, KV head, block) item kernels (the pool lookup's claims and the
  step prefetch's serve), ``min(256, next power of two ≥ B)``.

The batch size enters no compile key: it only sizes grids and tensors and moves the split plan (``S``,
``BPS``: runtime ints). So the variants a server can meet are enumerated by the widths up to its longest
table (:func:`width_classes`): at most ⌈log₂ GLUE_MAX_BLOCKS⌉ + 1 glue classes plus one torch-glue class,
15 in all. ``certvllm.attention.warmup`` compiles them at startup.

Why the opted-out ints are safe: they are loop bounds, clamps and row offsets. Their divisibility can only
widen vector loads along a row of a ``[·, B]`` array (``l8 + pid·B + pos`` in the glue kernels); with vLLM's
16-token GPU blocks one width in 16 is divisible by 16, so the unspecialised code is what already ran at the
other 15. Phase 1 and the attend pass put one block per warp and never load across blocks, so their code
does not depend on it. The value 1 (a one-column table, one split) only ever folded a loop bound.
Specialisation never changes the order of a floating-point operation: results are bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

from .common import GLUE_MAX_BLOCKS, next_pow2

ITEM_BLOCK_MAX = 256
"""Largest ``BLK`` of the pool and step-prefetch item kernels (block columns per program)."""

RUNTIME_INTS = ("num_blocks", "B", "TB_STRIDE", "S", "S2", "BPS", "nslots", "P", "CAP", "SPARSE", "KEY_T", "KEY_H",
                "VAL_T", "VAL_H", "ROWS", "TALLY_ROW", "GSTART", "PSTART")  # fmt: skip
"""Int arguments whose values follow the call (table width and row stride, split plan, the written keys' and
values' strides, a report's rows and its tally row, a chunked launch's first item) or the cache (its 16-token blocks,
pool slots, staging capacity and sparse threshold): never specialised (module docstring).
Every kernel passes the whole tuple; Triton ignores names a kernel does not have."""

CALLER_POINTERS = ("tables", "lens", "count", "tag", "tag_gen", "q_in")
"""Pointer arguments that may arrive as views at any offset (a caller's block table, lengths and queries, a slice of
a step counter, a ring slot's tags): never specialised on 16-byte alignment. Their rows start at offsets of
unknown alignment anyway (``RUNTIME_INTS`` strides), so the alignment bought no vector width."""

JIT_OPTIONS = {"do_not_specialize": RUNTIME_INTS, "do_not_specialize_on_alignment": CALLER_POINTERS}
"""The keyword arguments of every launched kernel's ``triton.jit`` / ``gluon.jit``."""


@dataclass(frozen=True)
class WidthClass:
    """What the launchers derive from a block-table width ``B`` for the compile key (module docstring).

    Attributes:
        bp: the glue kernels' ``BP``, the next power of two ≥ B; 0 when B > ``GLUE_MAX_BLOCKS`` (torch glue).
        item_block: ``BLK`` of the pool and step-prefetch item kernels, ``min(256, next power of two ≥ B)``.
    """

    bp: int
    item_block: int

    @property
    def glue(self) -> bool:
        """The glue kernels run (else their torch references)."""
        return self.bp > 0

    @property
    def log2bp(self) -> int:
        """``select``'s ``LOG2BP`` (glue classes only)."""
        return self.bp.bit_length() - 1

    def name(self) -> str:
        """A short label: ``BP=512`` or ``torch glue`` (with the item block)."""
        return f"BP={self.bp}" if self.glue else f"torch glue, BLK={self.item_block}"


def width_class(columns: int) -> WidthClass:
    """The class of a block table of ``columns`` 16-token block columns (≥ 1)."""
    if columns < 1:
        raise ValueError(f"a block table needs at least one column, got {columns}")
    p = next_pow2(columns)
    return WidthClass(bp=p if columns <= GLUE_MAX_BLOCKS else 0, item_block=min(ITEM_BLOCK_MAX, p))


def width_classes(max_columns: int, step: int = 1) -> dict[WidthClass, tuple[int, int]]:
    """Every class of the widths ``step, 2·step, …`` up to ``max_columns`` (the widths an engine with
    ``step`` 16-token blocks per engine block can give), with the narrowest and widest width of each, in
    increasing width."""
    if step < 1 or max_columns < step:
        raise ValueError(f"widths up to {max_columns} in steps of {step}: need 1 ≤ step ≤ max_columns")
    classes: dict[WidthClass, tuple[int, int]] = {}
    for b in range(step, max_columns + 1, step):
        cls = width_class(b)
        lo, _ = classes.get(cls, (b, b))
        classes[cls] = (lo, b)
    return classes
