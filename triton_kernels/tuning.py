"""The tuning knobs of the kernel layer, in one validated, immutable object.

Every launch-time choice that is not part of the certificate (tile sizes, warps, split plan, staging grid,
and whether the Gluon and CUDA kernels may run) is a field of :class:`KernelTuning`; the launchers take one as the
keyword argument ``tuning`` (default :data:`DEFAULT_TUNING`). None of them changes what is certified: each
configuration computes the same certified quantities (``tests/triton_kernels/test_gpu.py`` compares them).

* ``programs_per_sm``: the split-K plan's programs per multiprocessor (``common.split_plan``) of phase 1, and of
  the promotion and attend passes unless ``phase2_programs_per_sm`` is set.
* ``phase2_programs_per_sm``: the promotion and attend passes' own split plan (0: ``programs_per_sm``'s). Phase 2
  reads phase 1's outputs per block, so the two plans may differ; the passes fit different numbers of programs on a
  multiprocessor (registers), and a plan that is a whole multiple of a pass's resident programs leaves no
  part-empty last wave.
* ``promote_warps``: warps per program of the promotion pass (0: 2, or 8 for more than 4 query heads per KV head).
  The pass waits on one key page per program and iteration; fewer warps per program let more programs, and so more
  pages, be in flight on a multiprocessor. Two warps measured fastest at G = 4 (``docs/performance.md``); one warp
  takes ~200 registers per thread and was slower.
* ``promote_cuda``: 0 runs the promotion pass as the Triton kernel; 2 or 4 (the default) runs the CUDA kernel
  (``csrc/cuda/promote_kernel.cuh``: key pages streamed through a ``cp.async`` ring per warp) with that many warps
  per CUDA block, where it builds and takes the shape (``attend_cuda.promote_supported``); elsewhere the Triton
  kernel runs. Rungs 3/4's exact re-run always takes the Triton kernel.
* ``select_warps``: warps per program of the selection kernel (0: 4, more for tables over 2,048 blocks: ``BP/512``
  up to 16). Each program holds its head's whole table in registers; more warps spread it thinner.
* ``select_first_window``: with ``select_search=0``, on the selection's windowed path (tables wider than its window
  of ``W`` sorted positions, ``W`` ≥ ``k_max_widened`` + 1), a first window of this many positions (a power of two,
  0: none) is sorted first; where K* and rung 2's greedy count fall inside it, the ``W``-position sorts are skipped
  (the same decisions), else they run as before. A concentrated head decides in a few dozen blocks; a spread one pays for both windows.
* ``select_parts``: programs per query head of the selection kernel: 1 (keys and values in one), 2 (apart:
  a small batch waits for the longer of the two chains instead of both), 0: 2 where the doubled grid still gives
  each program its own multiprocessor (``select.select_parts``), else 1.
* ``select_search``: 1 (the default) finds the selection's counts (K* with its clamps and rung 1, rung 2's greedy
  count) by a bisection on each rule itself (``select._search``: one block-wide reduction of the count, the float64
  tail sum and the Δ maximum per step, stopping once one key is left between its bounds), then takes every block
  whose sort key is at or above the threshold found: no window, no compaction, no sort. 0 sorts a window of the
  order instead (``select_first_window`` and the window apply). The same decisions either way.
* ``phase1_blk``, ``phase1_warps``: blocks per loop iteration and warps per program of phase 1 (the Gluon
  phase-1 kernel takes one block per warp, the Triton one ``phase1_blk`` blocks in one batched dot).
* ``attend_blk``, ``attend_warps``: blocks per loop iteration of the Triton attend kernel, and warps per CUDA
  block of the CUDA attend kernel (``attend_cuda``: 2, 4 or 8) / per program of the Triton one.
* ``resident_maxnreg``: registers per thread of the Gluon resident pass at most (0: no cap). Uncapped it takes ~254
  (2 four-warp programs per SM); 168 or 128 admit 3 or 4 programs and spill 336 / 520 bytes (Triton 3.6, offline):
  which wins is the H200's to say (``benchmarks/probe_resident.py --tuning resident_maxnreg=168``).
* ``resident_warps``: warps per program of the Gluon resident pass (``fused_gluon``: one block per warp); the
  Triton resident pass (the interpreter's and the fallback) runs one warp per program, one block per
  iteration, its best layout at D = 128 (``docs/performance.md``).
* ``prefetch_programs``, ``prefetch_unroll``: the step prefetch's staging gather: its programs and the
  pages each has in flight (``prefetch.stage_pages``).
* ``rerun_if_node``: 1 puts the two-pass call's device re-run of rungs 3/4 (five launches that exit at once when no
  head escalated) inside a CUDA-graph conditional node when the call is captured, on a flag the epilogue sets when a
  head escalates, so a replay without escalation skips them; 0 launches them in every replay. Needs a torch with
  conditional-node capture (``CUDAGraph.begin_capture_to_if_node``); without it, or eagerly, the launches stay.
* ``tail_fork``: 1 (the default) forks the two-pass call's gather of the rows' partial blocks (zero-copy reads of the
  pinned shadow, PCIe-bound) onto the page-in engine's side stream when the call is captured in a CUDA graph too, a
  parallel branch joined before ``prepare`` that overlaps phase 1, as eager calls already run it; 0 captures it on
  the call's stream, in series before phase 1.
* ``dialect``: ``"auto"`` runs the Gluon kernels and the CUDA attend kernel where they compile (CUDA, a supported
  shape) and the Triton kernels otherwise (the interpreter included); ``"triton"`` always runs the Triton kernels
  (what tests and benchmarks that compare them pass).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Literal

DIALECTS = ("auto", "triton")


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


# field: (predicate, the allowed values in words)
_RULES = {
    "programs_per_sm": (lambda x: 1 <= x <= 256, "an integer in [1, 256]"),
    "phase2_programs_per_sm": (lambda x: 0 <= x <= 256, "0 (programs_per_sm) or an integer in [1, 256]"),
    "promote_warps": (lambda x: x == 0 or (_pow2(x) and x <= 16), "0 (2, or 8 for G > 4) or a power of two in [1, 16]"),
    "promote_cuda": (lambda x: x in (0, 2, 4), "0 (the Triton kernel), 2 or 4 (the CUDA kernel's warps)"),
    "select_warps": (lambda x: x == 0 or (_pow2(x) and x <= 16), "0 (4, BP/512 up to 16) or a power of two ≤ 16"),
    "select_first_window": (lambda x: x == 0 or (_pow2(x) and 4 <= x <= 1024), "0 or a power of two in [4, 1024]"),
    "select_parts": (lambda x: x in (0, 1, 2), "0 (by the batch), 1 (keys and values in one program) or 2 (apart)"),
    "select_search": (lambda x: x in (0, 1), "0 (sort a window of the order) or 1 (bisect on the rules)"),
    "phase1_blk": (lambda x: _pow2(x) and x <= 64, "a power of two in [1, 64]"),
    "phase1_warps": (lambda x: _pow2(x) and x <= 32, "a power of two in [1, 32]"),
    "attend_blk": (lambda x: _pow2(x) and x <= 64, "a power of two in [1, 64]"),
    "attend_warps": (lambda x: _pow2(x) and x <= 32, "a power of two in [1, 32]"),
    "resident_warps": (lambda x: _pow2(x) and x <= 16, "a power of two in [1, 16]"),
    "resident_maxnreg": (lambda x: x == 0 or 24 <= x <= 255, "0 (no cap) or an integer in [24, 255]"),
    "prefetch_programs": (lambda x: 1 <= x <= 1024, "an integer in [1, 1024]"),
    "prefetch_unroll": (lambda x: _pow2(x) and x <= 64, "a power of two in [1, 64]"),
    "rerun_if_node": (lambda x: x in (0, 1), "0 (the re-run launched in every replay) or 1 (in a conditional node)"),
    "tail_fork": (lambda x: x in (0, 1), "0 (captured in series) or 1 (forked onto the side stream in graphs too)"),
}


@dataclass(frozen=True)
class KernelTuning:
    """Launch parameters of the kernels (module docstring); validated on construction."""

    programs_per_sm: int = 8
    phase2_programs_per_sm: int = 0
    promote_warps: int = 0
    promote_cuda: int = 4
    select_warps: int = 0
    select_first_window: int = 0
    select_parts: int = 0
    select_search: int = 1
    phase1_blk: int = 4
    phase1_warps: int = 4
    attend_blk: int = 4
    attend_warps: int = 4
    resident_warps: int = 4
    resident_maxnreg: int = 0
    prefetch_programs: int = 8
    prefetch_unroll: int = 4
    rerun_if_node: int = 0
    tail_fork: int = 1
    dialect: Literal["auto", "triton"] = "auto"

    def __post_init__(self) -> None:
        defaults = {f.name: f.default for f in fields(self)}
        for name, (ok, allowed) in _RULES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
                raise ValueError(
                    f"KernelTuning.{name}={value!r} is out of range: it must be {allowed}; pass e.g. "
                    f"KernelTuning({name}={defaults[name]!r}) (the default)"
                )
        if self.dialect not in DIALECTS:
            raise ValueError(
                f"KernelTuning.dialect={self.dialect!r} is not a kernel dialect: it must be one of "
                f"{', '.join(map(repr, DIALECTS))}; pass KernelTuning(dialect='auto') (the default: Gluon where it "
                "compiles) or KernelTuning(dialect='triton') (the Triton kernels only)"
            )


DEFAULT_TUNING = KernelTuning()
"""The tuning every launcher uses unless given another."""


def tuning_overrides(items: list[str]) -> dict:
    """``["promote_warps=4", "dialect=triton", ...]`` → the ``KernelTuning`` keyword arguments they spell, checked
    by building one. Raises ``ValueError`` naming the entry and the fix: an entry without ``=``, a name that is not
    a field (the fields are listed), a value out of range (``KernelTuning``'s message)."""
    known = [f.name for f in fields(KernelTuning)]
    out: dict = {}
    for item in items:
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise ValueError(f"{item!r}: write FIELD=VALUE, e.g. promote_warps=2")
        if name not in known:
            raise ValueError(f"{name!r} is not a KernelTuning field; the fields are {', '.join(known)}")
        if name == "dialect":
            out[name] = value
        else:
            try:
                out[name] = int(value)
            except ValueError:
                raise ValueError(f"KernelTuning.{name}={value!r} is not an integer; write e.g. {name}=2") from None
    KernelTuning(**out)
    return out


@functools.lru_cache(maxsize=64)
def parse_tuning(text: str) -> KernelTuning:
    """A ``KernelTuning`` from comma-separated ``FIELD=VALUE`` pairs (``CertConfig.kernel_tuning``, the benchmarks'
    ``--tunings`` entries); ``""`` is :data:`DEFAULT_TUNING`. Raises ``ValueError`` as :func:`tuning_overrides`."""
    items = [x for x in text.split(",") if x.strip()]
    return KernelTuning(**tuning_overrides(items)) if items else DEFAULT_TUNING
