"""A prefill's originals into the host tier by the copy engines: the engine blocks it fills, staged on the device and
copied to the shadow with ``cudaMemcpyAsync`` on a side stream, off the SMs and off the layer's stream.

The device write path stores every token's key and value rows into the pinned shadow from the SMs
(``triton_kernels.shadow_write``): PCIe-bound, on the layer's stream, so a prefill's stores hold up the model's own
kernels for as long as they take (about 0.7 ms per layer per 8K-token chunk at LLaMA-3.1-8B shapes). Here the
engine blocks a write fills completely are first laid out on the device in the shadow's own layout (two strided
device copies, microseconds), then copied to the shadow by DMA, one copy per run of consecutive engine block ids,
on a side stream that starts after the staging. The remaining tokens (a chunk's partial first and last blocks,
decode rows) keep the SM stores. Same shadow bytes and write generations as the SM path for every token.

Staging buffer byte layout (the shadow's, ``triton_kernels.shadow_write``'s docstring)::

    stage [n, H_kv, 2, M·N, D]  model dtype   row i: the i-th engine block of the write's runs, in run order;
                                              [:, :, 0] keys, [:, :, 1] values, tokens in slot order

so run r (``blocks`` rows from staging row o) is the contiguous byte range ``stage[o : o + blocks]`` and lands on
the contiguous range ``shadow[block : block + blocks]``: one copy.

Ordering. The copies run on this object's stream, after an event on the caller's stream (so after the staging and
everything queued before it). Nothing else reads the written blocks in the same step: a prefill's exact attention
reads this step's keys and values from the write itself, and its completed blocks are encoded from it too; a later
write of the step stores other blocks (a block the runs copy was whole in this write). Readers of later steps are
ordered after the copies by :meth:`ShadowCopier.fence`: a wait on the event recorded after the last copies, which
the worker issues when a step's batch is built and again on the forward's stream at the write of the step's first
certified layer, before anything of the step reads the shadow (so whichever stream vLLM builds or runs on). The
staging buffer is returned to the allocator only once the copy stream is past it (``Tensor.record_stream``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from certvllm.kv.cache import LayerKVCache


class ShadowRun(NamedTuple):
    """Engine blocks ``block … block + blocks − 1`` filled by the write's tokens ``token … token + blocks·M·N − 1``
    (indices into the write's ``key``/``value``/``slots``), in slot order."""

    token: int
    block: int
    blocks: int


def full_block_runs(first_token: int, context: int, query_len: int, block_ids: Sequence[int] | np.ndarray,
                    block_size: int) -> list[ShadowRun]:  # fmt: skip
    """The engine blocks that one request's write fills completely, as runs of consecutive block ids.

    Args:
        first_token: index of the request's first token of this write in the step's token order.
        context: tokens of the request already in the cache (the write covers positions
            ``context … context + query_len − 1``).
        query_len: tokens of the request in this write.
        block_ids: the request's engine block ids by position (its row of the block table, at least up to the
            block of position ``context + query_len − 1``).
        block_size: tokens per engine block (``M·N``).
    """
    if block_size <= 0 or context < 0 or query_len < 0:
        raise ValueError(f"block_size={block_size}, context={context}, query_len={query_len}: need block_size > 0 "
                         "and non-negative lengths")  # fmt: skip
    first = -(-context // block_size)  # the first block that starts inside the write
    last = (context + query_len) // block_size  # one past the last block that ends inside it
    if last <= first:
        return []
    ids = np.asarray(block_ids[first:last], dtype=np.int64)
    if ids.shape[0] != last - first:
        raise ValueError(f"block table row has {len(block_ids)} entries; positions up to {context + query_len - 1} "
                         f"need {last}")  # fmt: skip
    starts = np.concatenate(([0], np.flatnonzero(np.diff(ids) != 1) + 1))
    ends = np.append(starts[1:], ids.shape[0])
    return [ShadowRun(first_token + (first + int(s)) * block_size - context, int(ids[s]), int(e - s))
            for s, e in zip(starts, ends, strict=True)]  # fmt: skip


def uncovered_ranges(total: int, covered: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges of ``[0, total)`` outside the ``covered`` ones (``(start, end)``, any order, not overlapping), in
    order, empty ones left out."""
    out, at = [], 0
    for start, end in sorted(covered):
        if start < at:
            raise ValueError(f"token ranges overlap at {start} (the previous one ends at {at})")
        if start > at:
            out.append((at, start))
        at = end
    if at < total:
        out.append((at, total))
    return out


class ShadowCopier:
    """Copies runs of a write's full engine blocks to the shadow (module docstring); one per device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._landed: torch.cuda.Event | None = None  # recorded on the copy stream after the last copies
        self.bytes_copied = 0  # host-side count of bytes handed to the copy engines (or copied, off CUDA)

    def write(self, cache: LayerKVCache, key: torch.Tensor, value: torch.Tensor,
              runs: Sequence[ShadowRun]) -> list[tuple[int, int]]:  # fmt: skip
        """Stage the tokens of ``runs`` and queue their copies to ``cache.shadow``; add one write per token to their
        16-token blocks' generations (as the SM stores do). Returns the token ranges ``[(start, end), ...]`` of the
        write that the runs leave to the SM stores, in order.

        Args:
            cache: the layer's cache (token-major shadow ``[E, H_kv, 2, M·N, D]``).
            key, value: ``[T, H_kv, D]`` in the shadow's dtype (channel stride 1), on the pages' device.
            runs: from :func:`full_block_runs`; every run's tokens within ``[0, T)``, no two overlapping.
        """
        shadow = cache.shadow
        if cache.keys_channel_major:
            raise ValueError("copy-engine shadow writes need a token-major shadow (the CPU layout is channel-major)")
        e, h, _, mn, d = shadow.shape
        t = key.shape[0]
        for r in runs:
            if r.blocks <= 0 or r.token < 0 or r.token + r.blocks * mn > t or not 0 <= r.block <= e - r.blocks:
                raise ValueError(f"{r} does not fit a write of {t} tokens into {e} engine blocks of {mn} tokens")
        rest = uncovered_ranges(t, [(r.token, r.token + r.blocks * mn) for r in runs])
        if not runs:
            return rest
        stage = torch.empty((sum(r.blocks for r in runs), h, 2, mn, d), dtype=shadow.dtype, device=key.device)
        at = 0
        for r in runs:
            n = r.blocks * mn
            for half, src in ((0, key), (1, value)):
                stage[at : at + r.blocks, :, half].copy_(src[r.token : r.token + n].unflatten(0, (r.blocks, mn))
                                                         .transpose(1, 2))  # fmt: skip
            if cache.generation is not None:  # the SM stores add 1 per token to its 16-token block
                m, per = cache.sub_blocks, mn // cache.sub_blocks
                cache.generation[r.block * m : (r.block + r.blocks) * m] += per
            at += r.blocks
        self._copy(shadow, stage, runs)
        self.bytes_copied += stage.numel() * stage.element_size()
        return rest

    def _copy(self, shadow: torch.Tensor, stage: torch.Tensor, runs: Sequence[ShadowRun]) -> None:
        """One copy per run, on the side stream on CUDA (after everything queued so far), in order elsewhere."""

        def copies() -> None:
            at = 0
            for r in runs:
                shadow[r.block : r.block + r.blocks].copy_(stage[at : at + r.blocks], non_blocking=True)
                at += r.blocks

        if self.stream is None or stage.device.type != "cuda":
            copies()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copies()
            landed = torch.cuda.Event()
            landed.record(self.stream)
        stage.record_stream(self.stream)
        self._landed = landed

    def fence(self) -> None:
        """Order the current stream after every copy queued so far (call before queueing work that may read the
        shadow blocks they write: at the start of each step, on each stream that will). Any number of streams may
        fence on the same copies; none while it is being captured into a CUDA graph (the wait is not issued)."""
        if self._landed is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_event(self._landed)
