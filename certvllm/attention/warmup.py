"""Startup warm-up of the CUDA certified path: compile every kernel variant a server can meet before it serves.

Triton compiles a kernel the first time a launch meets a new compile key, which takes seconds; inside a
server that would stall a live request. The compile keys
of the CUDA path depend, once the model's head layout, the KV dtype, the page layout and the config are
fixed, only on the block-table width's class (``certvllm.triton_kernels.shape_class``: the runtime ints
that follow the length, the batch or the cache are not specialised). :func:`shape_classes` enumerates the
classes of the widths up to ``max_model_len`` — at most 15 — and :func:`warm_up` runs the public op
``certified_attention`` once per class (twice with the step prefetch: without and with a staging) on a small
:class:`~certvllm.attention.synthetic.SyntheticLayer`, whose block tables repeat a few real encoded blocks.
That reaches every kernel of a layer call (phase 1, prepare, select, the pool lookup, the step prefetch's
serve, snapshot and staging, the promotion and attend passes with their device re-run, finalize, combine)
plus the write kernel and the page-in gather (and, where the config has a pool, its variant that reads a
write-through pool's keys, the exact prefill's); with audits on (``audit_rate`` > 0), one audited call compiles the
audit's device checks. No batch class remains: the batch size only sizes grids and
tensors, so one row per class is enough.

On the CPU there is nothing to compile per shape: the certified CPU path is the C++ kernel built ahead of
time (``python -m certvllm.kernels.cpu``) or torch, so :func:`warm_up` returns at once with an empty report.

On a CUDA device the classes are first compiled in parallel child processes into the same disk cache
(``certvllm.attention.precompile``, ``CertConfig.warmup_workers``); the serial pass then loads them, and compiles
whatever a failed child left. Failures of the serial pass raise :class:`WarmupError` naming the class.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from certvllm.attention.precompile import (
    LayerSpec,
    PrecompileReport,
    compiler_fingerprint,
    plan_workers,
    precompile,
    serial_misses,
)
from certvllm.attention.synthetic import SyntheticLayer, engine_sub_blocks, table_width
from certvllm.config import CertConfig
from certvllm.env import triton_cache_scope
from certvllm.formats.layout import BLOCK_SIZE
from certvllm.triton_kernels import jit_cache
from certvllm.triton_kernels.common import GLUE_MAX_BLOCKS
from certvllm.triton_kernels.shape_class import WidthClass, width_classes

logger = logging.getLogger("vllm.certvllm")
T = TypeVar("T")

MAX_CLASSES = GLUE_MAX_BLOCKS.bit_length() + 1
"""Most shape classes of any server (15): one per power of two up to ``GLUE_MAX_BLOCKS`` (8192: 14) and one
for wider tables (torch glue)."""


class WarmupError(RuntimeError):
    """A kernel variant failed to compile or run at warm-up; the message names the shape class."""


@dataclass(frozen=True)
class ShapeClass:
    """One compile class of a server's certified calls: the block-table widths ``lo``–``hi`` (16-token block
    columns, multiples of the engine's ``m``) that share the width class ``width``. Head layout, KV dtype,
    page layout and config are the server's, the same in every class; the batch size is in no compile key.

    Attributes:
        width: the class (``bp``: the glue kernels' ``BP``; ``item_block``: the pool/prefetch ``BLK``).
        lo, hi: the narrowest and widest table of the class the server can meet.
    """

    width: WidthClass
    lo: int
    hi: int

    def name(self) -> str:
        """``block tables of 513–1024 columns (BP=1024)``: what error messages and the report call the class."""
        if self.lo == self.hi:
            cols = f"{self.lo} column" + ("s" if self.lo > 1 else "")
        else:
            cols = f"{self.lo}–{self.hi} columns"
        return f"block tables of {cols} ({self.width.name()})"

    def warm_length(self, max_model_len: int) -> int:
        """A context length whose table is the class's widest: ``16·hi − 7`` tokens (a partial last block),
        capped at ``max_model_len`` (the cap keeps the width: ``hi`` is the width of ``max_model_len``)."""
        return min(BLOCK_SIZE * self.hi - 7, max_model_len)


def shape_classes(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_model_len: int,
    max_num_seqs: int,
    config: CertConfig,
    *,
    block_size_tokens: int = 16,
) -> list[ShapeClass]:
    """The shape classes of every certified call a server can make (module docstring), narrowest first.

    Args:
        num_q_heads, num_kv_heads, head_dim: the model's attention layout (per worker).
        max_model_len: the longest context (tokens); tables are at most ``⌈max_model_len / block⌉·m`` wide.
        max_num_seqs: the largest batch; validated only, since the batch enters no compile key.
        config: the server's config; ``mode: dense`` makes no certified call (no classes).
        block_size_tokens: the engine's block size (16 on GPUs), a multiple of 16.

    Returns:
        At most :data:`MAX_CLASSES` classes.
    """
    if num_kv_heads < 1 or num_q_heads % num_kv_heads or head_dim < 1:
        raise ValueError(f"invalid head layout H_q={num_q_heads}, H_kv={num_kv_heads}, D={head_dim}")
    if max_model_len < 1 or max_num_seqs < 1:
        raise ValueError(f"max_model_len={max_model_len} and max_num_seqs={max_num_seqs} must be ≥ 1")
    m = engine_sub_blocks(block_size_tokens)
    if config.mode == "dense":
        return []
    classes = width_classes(table_width(max_model_len, block_size_tokens), m)
    return [ShapeClass(w, lo, hi) for w, (lo, hi) in classes.items()]


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warm_up` did.

    Attributes:
        device: the device warmed (``cuda:0`` …).
        classes: the shape classes run, narrowest first (empty on the CPU and in dense mode).
        seconds: wall seconds per class (its calls and their compiles).
        compilations: kernel variants compiled (or loaded from Triton's disk cache) per class.
        total_seconds: the whole warm-up, the synthetic layer's setup included.
        total_compilations: kernel variants made by the whole warm-up (the write kernel's and the gather's too).
        note: why nothing ran, when nothing did.
        precompile: the parallel compile that ran first (``total_seconds`` includes it), or None.
        misses: after a parallel compile, the variants the serial pass compiled although a child should have left
            them in the disk cache (``precompile.serial_misses``; empty when it only loaded).
    """

    device: str
    classes: tuple[ShapeClass, ...] = ()
    seconds: tuple[float, ...] = ()
    compilations: tuple[int, ...] = ()
    total_seconds: float = 0.0
    total_compilations: int = 0
    note: str = ""
    precompile: PrecompileReport | None = None
    misses: str = ""

    def summary(self) -> str:
        """One log line."""
        if not self.classes:
            return f"certvllm warm-up on {self.device}: nothing to compile ({self.note})"
        slowest = max(range(len(self.classes)), key=lambda i: self.seconds[i])
        parallel = "" if self.precompile is None else f"{self.precompile.summary()}, then "
        return (
            f"certvllm warm-up on {self.device}: {len(self.classes)} shape classes, {self.total_compilations} "
            f"kernel variants compiled in {self.total_seconds:.1f} s ({parallel}slowest class of the serial pass: "
            f"{self.classes[slowest].name()}, {self.seconds[slowest]:.1f} s)"
        )

    def lines(self) -> list[str]:
        """One line per class (for a debug log)."""
        return [
            f"  {c.name()}: {s:.2f} s, {n} variants"
            for c, s, n in zip(self.classes, self.seconds, self.compilations, strict=True)
        ]


def triton_compilations() -> int:
    """Variants of certvllm's Triton/Gluon kernels compiled in this process so far (0 under the interpreter);
    the difference of two reads is the compilations in between (``triton_kernels.jit_cache``)."""
    return jit_cache.compilations()


def warm_up(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_model_len: int,
    max_num_seqs: int,
    config: CertConfig,
    device: torch.device | str,
    block_size_tokens: int = 16,
    scale: float | None = None,
) -> WarmupReport:
    """Compile every kernel variant of the server's certified calls on ``device`` (module docstring).

    Args:
        num_q_heads, num_kv_heads, head_dim: the model's attention layout in this worker.
        dtype: the KV dtype (float16 or bfloat16).
        max_model_len, max_num_seqs: the server's limits.
        config: the server's config.
        device: the worker's device; on the CPU nothing runs.
        block_size_tokens: the engine's block size.
        scale: the softmax scale (no compile key depends on it; None: ``1/√D``).

    Returns:
        The :class:`WarmupReport`. Raises :class:`WarmupError` naming the class whose calls failed.
    """
    dev = torch.device(device)
    classes = shape_classes(num_q_heads, num_kv_heads, head_dim, max_model_len, max_num_seqs, config,
                            block_size_tokens=block_size_tokens)  # fmt: skip
    if dev.type != "cuda":
        return WarmupReport(str(dev), note="the CPU path has no per-shape JIT kernels")
    if not classes:
        return WarmupReport(str(dev), note="mode dense makes no certified call")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    spec = LayerSpec(num_q_heads, num_kv_heads, head_dim, str(dtype).removeprefix("torch."), max_model_len,
                     max_num_seqs, config.model_dump(mode="json"), str(dev), block_size_tokens, scale)  # fmt: skip
    pre = None
    workers = plan_workers(config, len(classes), dev)
    if workers:
        with triton_cache_scope():  # the children inherit certvllm's cache folder
            pre = precompile(spec, [max(c.width.bp, c.hi) for c in classes], workers)
    rng = torch.cuda.get_rng_state(dev)  # exploration draws use the device's default generator: leave no trace
    before = jit_cache.variant_keys() if pre is not None else set()
    try:
        report = run_classes(classes, max_model_len, spec.describe(), lambda: spec.make_layer(config))
    finally:
        torch.cuda.set_rng_state(rng, dev)
    if pre is None:
        return report
    made = jit_cache.variant_keys() - before
    misses = serial_misses(made, pre.variants, compiler_fingerprint(), pre.backend) if pre.variants else ""
    if misses:
        logger.warning("certvllm warm-up: %s", misses)
    return replace(report, precompile=pre, total_seconds=report.total_seconds + pre.seconds, misses=misses)


def run_classes(
    classes: list[ShapeClass], max_model_len: int, what: str, make_layer: Callable[[], SyntheticLayer]
) -> WarmupReport:
    """Build the synthetic layer with ``make_layer()``, then run each class's calls (:func:`warm_class`),
    timing and counting compilations. ``what`` names the head layout in error messages. Runs wherever the
    layer's device runs the CUDA path (the CPU under the interpreter, for tests). The kernels compile into
    certvllm's own Triton cache (``certvllm.env.triton_cache_scope``), not vLLM's per-config folder, so a
    restarted server loads them from disk."""
    with triton_cache_scope():
        return _run_classes(classes, max_model_len, what, make_layer)


def _run_classes(
    classes: list[ShapeClass], max_model_len: int, what: str, make_layer: Callable[[], SyntheticLayer]
) -> WarmupReport:
    start = time.perf_counter()
    before = jit_cache.compilations()
    try:
        layer = make_layer()
        _sync(layer.device)
    except Exception as err:
        raise WarmupError(f"certvllm warm-up ({what}) failed building its synthetic layer: "
                          f"{type(err).__name__}: {err}") from err  # fmt: skip
    seconds, counts = [], []
    for cls in classes:
        t0, c0 = time.perf_counter(), jit_cache.compilations()
        try:
            warm_class(layer, cls, max_model_len)
            _sync(layer.device)
        except Exception as err:
            msg = f"certvllm warm-up ({what}) failed at {cls.name()}: {type(err).__name__}: {err}"
            raise WarmupError(msg) from err
        seconds.append(time.perf_counter() - t0)
        counts.append(jit_cache.compilations() - c0)
    if layer.direct is not None:  # the exact prefill's gather through a write-through pool: no shape in its key
        _shapeless(layer, what, "the cached-context gather", layer.gather_cached_context)
    if layer.config.audit_rate > 0:  # the audit's device checks: no shape in their compile key, one call compiles them
        violations = _shapeless(layer, what, "the audit's checks", lambda: layer.audited_call([BLOCK_SIZE + 1]))
        if violations:  # logged, not raised: the audit goes on checking served head-steps and applies its policy
            logger.error("certvllm warm-up (%s): the audit found %d head-step(s) of a synthetic call outside "
                         "their certificate: the certified path may not be sound on this device", what,
                         violations)  # fmt: skip
    return WarmupReport(str(layer.device), tuple(classes), tuple(seconds), tuple(counts), time.perf_counter() - start,
                        jit_cache.compilations() - before)  # fmt: skip


def _shapeless(layer: SyntheticLayer, what: str, name: str, run: Callable[[], T]) -> T:
    """``run()`` once (kernels whose compile key has no shape), synchronised; a failure raised as
    :class:`WarmupError` naming ``name``."""
    try:
        result = run()
        _sync(layer.device)
    except Exception as err:
        raise WarmupError(f"certvllm warm-up ({what}) failed at {name}: {type(err).__name__}: {err}") from err
    return result


def warm_class(layer: SyntheticLayer, cls: ShapeClass, max_model_len: int) -> None:
    """The calls of one class: one row at the class's widest table; with a step prefetch once more after a
    step start, so that its serve kernel runs both without a staging (the first call of a layer or a new
    grid) and with one (every later step), and its snapshot and staging kernels run; once more with a
    write-through pool (its re-run reads the pool's keys through another variant), where the config has a pool."""
    lens = [cls.warm_length(max_model_len)]
    layer.call(lens)
    if layer.prefetcher is not None:
        layer.call(lens, begin_step=True)
    if layer.direct is not None:
        layer.call(lens, write_through=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
