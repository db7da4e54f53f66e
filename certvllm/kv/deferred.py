"""Device values read off the hot path: snapshots of device tensors taken without a host synchronisation.

A layer call on CUDA must not wait for the GPU (``.tolist()``, ``.item()``, a blocking copy to the host):
each such wait stalls the CPU until every kernel queued so far has run, so it can no longer launch the
next layer while the GPU works. Counters are therefore accumulated on the device and read later:

* :class:`DeferredRead` queues a non-blocking copy of a few device tensors into pinned host memory and
  records a CUDA event on the current stream behind it. Nothing waits. Whoever resolves it later (the
  metrics' flusher thread) waits on the event (``event.synchronize()``: it blocks that thread only and
  launches nothing on the device streams) and reads the host copy. On the CPU the copy is taken at once
  and there is no event.
* :meth:`DeferredRead.take` snapshots a counter tensor and then zeroes it on the device, both in stream
  order: the copy reads the counts of every kernel queued before it, the next calls count from 0.
* :class:`DeferredStats` names the snapshot's values and adds the counts known on the host (page-in bytes
  of host gathers, seconds), for ``take_stats_deferred`` of the page-in engine, the promotion pool and the
  step prefetcher.

Several tensors of one read are packed into one byte buffer on the device (:func:`pack`: one ``cat``, one
copy, one event per read), widest dtype first so that every tensor's host view stays aligned. A
:class:`ReadBatch` goes one step further: the counters and the report of one layer call (the page-in engine's,
the promotion pool's, the step prefetcher's) join one read, so a call queues one pinned copy and one event, and
the metrics' flusher unpacks one buffer, instead of one each.

This module lives in ``certvllm.kv`` (below ``certvllm.metrics``) because the counters' owners need it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def pack(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The bytes of ``tensors`` in one ``[nbytes]`` uint8 tensor on their device, widest element first (so
    each tensor starts at a multiple of its element size), and each tensor's byte offset. One tensor is
    returned as a byte view of itself (no kernel when it is contiguous); several take one ``cat``."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    offsets, at = [0] * len(tensors), 0
    for i in order:
        offsets[i] = at
        at += tensors[i].numel() * tensors[i].element_size()
    flat = [tensors[i].reshape(-1).contiguous().view(torch.uint8) for i in order]  # a strided 1-D stays strided
    if not flat:
        return torch.empty(0, dtype=torch.uint8), offsets
    return (flat[0] if len(flat) == 1 else torch.cat(flat)), offsets


def unpack(buffer: torch.Tensor, specs: Sequence[tuple[torch.dtype, tuple[int, ...]]],
           offsets: Sequence[int]) -> list[torch.Tensor]:  # fmt: skip
    """Views of ``buffer`` (``[nbytes]`` uint8, from :func:`pack`) as the tensors ``specs`` (dtype, shape)."""
    out = []
    for (dtype, shape), at in zip(specs, offsets, strict=True):
        n = torch.Size(shape).numel() * dtype.itemsize
        out.append(buffer[at : at + n].view(dtype).view(shape))
    return out


class DeferredRead:
    """Host copies of ``tensors`` taken in stream order, readable once the device has produced them.

    Args:
        tensors: tensors of any shapes and dtypes, all on one device. CUDA: packed (:func:`pack`), copied
            into a pinned ``[nbytes]`` uint8 host buffer without blocking, and a CUDA event recorded on the
            current stream behind the copy; any other device: copied to the host at once (a snapshot).
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        tensors = list(tensors)
        if any(t.requires_grad for t in tensors):  # the hot path's tensors carry no autograd: no detach calls
            tensors = [t.detach() for t in tensors]
        self._specs = [(t.dtype, tuple(t.shape)) for t in tensors]
        self._event: torch.cuda.Event | None = None
        self._device: torch.device | None = None
        self._host: list[torch.Tensor] | None = None
        self._buffer: torch.Tensor | None = None
        self._offsets: list[int] = []
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"a deferred read takes tensors of one device, got {sorted(map(str, devices))}")
        device = devices.pop() if devices else torch.device("cpu")
        if device.type != "cuda":
            self._host = [t.to("cpu", copy=True) for t in tensors]
            return
        packed, self._offsets = pack(tensors)
        self._buffer = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=True)
        self._buffer.copy_(packed, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))
        self._device = device

    @classmethod
    def take(cls, counts: torch.Tensor) -> DeferredRead:
        """Snapshot ``counts`` and zero it, in stream order (read-and-reset without a synchronisation)."""
        read = cls([counts])
        counts.zero_()
        return read

    @property
    def pinned(self) -> bool:
        """Whether the host copy lives in pinned memory (a CUDA read)."""
        return self._buffer is not None and self._buffer.is_pinned()

    def done(self) -> bool:
        """Whether the host copy can be read without waiting (never waits)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block this thread until the host copy has landed (launches nothing on the device)."""
        if self._event is not None:
            with torch.cuda.device(self._device):
                self._event.synchronize()

    def values(self) -> list[torch.Tensor]:
        """The host tensors, in the order and with the shapes and dtypes given (waits if needed)."""
        if self._host is None:
            self.wait()
            self._host = unpack(self._buffer, self._specs, self._offsets)
            self._event = None
        return self._host


class ReadBatch:
    """Device tensors to read together (one :class:`DeferredRead`), each member handed a :class:`BatchedRead`.

    Members join with :meth:`add` (a snapshot) or :meth:`add_take` (a snapshot, then the tensor zeroed on the
    device: read-and-reset), then :meth:`issue` queues the one read, in stream order, and zeroes the taken
    tensors behind it. A member read before :meth:`issue` is an error (nothing was queued for it)."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []
        self._resets: list[torch.Tensor] = []
        self.read: DeferredRead | None = None

    def add(self, tensors: Sequence[torch.Tensor]) -> BatchedRead:
        """Add ``tensors`` (on the batch's one device); their host copies come from :meth:`BatchedRead.values`."""
        if self.read is not None:
            raise RuntimeError("this read batch was issued already: start a new ReadBatch")
        start = len(self._tensors)
        self._tensors.extend(tensors)
        return BatchedRead(self, start, len(tensors))

    def add_take(self, counts: torch.Tensor) -> BatchedRead:
        """Add ``counts`` and zero it once the read is queued (:meth:`DeferredRead.take`, batched)."""
        member = self.add([counts])
        self._resets.append(counts)
        return member

    def issue(self) -> DeferredRead:
        """Queue the read of every member (one pack, one copy, one event), then zero the taken counters."""
        if self.read is None:
            self.read = DeferredRead(self._tensors)
            for counts in self._resets:
                counts.zero_()
        return self.read


def take(counts: torch.Tensor, batch: ReadBatch | None = None) -> DeferredRead | BatchedRead:
    """Read-and-reset ``counts``: as a member of ``batch`` (zeroed when it is issued), or alone
    (:meth:`DeferredRead.take`)."""
    return batch.add_take(counts) if batch is not None else DeferredRead.take(counts)


class BatchedRead:
    """One member of a :class:`ReadBatch`: ``count`` tensors from ``start``, with :class:`DeferredRead`'s
    ``done`` / ``wait`` / ``values``."""

    def __init__(self, batch: ReadBatch, start: int, count: int) -> None:
        self._batch, self._start, self._count = batch, start, count

    def _read(self) -> DeferredRead:
        if self._batch.read is None:
            raise RuntimeError("a batched read was resolved before its batch was issued (ReadBatch.issue)")
        return self._batch.read

    def done(self) -> bool:
        return self._read().done()

    def wait(self) -> None:
        self._read().wait()

    def values(self) -> list[torch.Tensor]:
        return self._read().values()[self._start : self._start + self._count]


class DeferredStats:
    """Named counters: values known on the host now plus the values of a :class:`DeferredRead` later.

    Args:
        host: counts known now (name → value).
        names: the names of the deferred read's first tensor's entries (a ``[len(names)]`` tensor).
        read: the device part (None: host counts only), alone or as a member of a :class:`ReadBatch`.
    """

    def __init__(self, host: Mapping[str, float] | None = None, names: Sequence[str] = (),
                 read: DeferredRead | BatchedRead | None = None) -> None:  # fmt: skip
        self._host = dict(host or {})
        self._names = tuple(names)
        self._read = read
        self._values: dict[str, float] | None = None

    @classmethod
    def of(cls, values: Mapping[str, float]) -> DeferredStats:
        """Counts that are all known now."""
        return cls(values)

    def done(self) -> bool:
        """Whether :meth:`values` would not wait."""
        return self._read is None or self._read.done()

    def wait(self) -> None:
        """Block until the device part has landed (launches nothing on the device)."""
        if self._read is not None:
            self._read.wait()

    def values(self) -> dict[str, float]:
        """Every count: the host ones plus the device ones (ints stay ints); waits if needed."""
        if self._values is None:
            values = dict(self._host)
            if self._read is not None:
                device = self._read.values()[0].reshape(-1).tolist()  # a host tensor: no synchronisation
                for name, v in zip(self._names, device, strict=True):
                    values[name] = values.get(name, 0) + v
            self._values, self._read = values, None
        return self._values

    def __getitem__(self, name: str) -> float:
        return self.values()[name]
