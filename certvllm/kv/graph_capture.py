"""Capturing one call into a CUDA graph on a side stream, and the store of such graphs that certvllm's graphed
calls share (the certified layer calls of ``certvllm.attention.graphs``, the device write path of
``certvllm.kv.write_graphs``).

``torch.cuda.graph`` synchronises the device and collects garbage around every capture; these captures happen
while a vLLM step is running and while the metrics' flusher thread uses CUDA, so they are taken on a side stream
that waits for the current one, in ``thread_local`` capture mode (other threads' CUDA calls are not captured and
do not break the capture), and the current stream waits for the side stream afterwards.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Generic, TypeVar

import torch

logger = logging.getLogger("certvllm")
T = TypeVar("T")
E = TypeVar("E")  # a store's entry: a graph with what its replays read and write
I = TypeVar("I")  # noqa: E741 - a store's static inputs, shared by the graphs of one shape


def capture_on_side_stream(
    device: torch.device, pool: Any, call: Callable[[], T], context: AbstractContextManager | None = None
) -> tuple[torch.cuda.CUDAGraph, T, Any]:
    """Capture ``call()`` into a new graph that allocates from ``pool``; returns the graph, what ``call``
    returned during capture (tensors the graph's replays rewrite in place) and what ``context`` gave on entry.
    Nothing runs on the device during capture: the caller runs the call eagerly first when it needs its effect
    or answer (and to compile kernels).

    Args:
        device: the CUDA device of the call.
        pool: a ``torch.cuda.graph_pool_handle()`` (graphs sharing a pool may reuse each other's scratch).
        call: the work to record (device work only: no host synchronisation).
        context: entered around the capture (e.g. a page-in engine's traffic recording), or None.

    Raises:
        RuntimeError: the capture failed (the caller decides whether to go on eagerly).
    """
    graph = torch.cuda.CUDAGraph()
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(main)
    try:
        with torch.cuda.stream(side), context or nullcontext() as entered:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                result = call()
            finally:
                graph.capture_end()
    finally:
        main.wait_stream(side)
    return graph, result, entered


def conditional_nodes_supported() -> bool:
    """Whether this torch records CUDA-graph conditional nodes (``CUDAGraph.begin_capture_to_if_node``)."""
    graph = torch.cuda.CUDAGraph
    return hasattr(graph, "get_currently_capturing_graph") and hasattr(graph, "begin_capture_to_if_node")


@contextmanager
def if_node(pred: torch.Tensor) -> Iterator[bool]:
    """Record the device work of the block as the body of an IF conditional node of the graph being captured on
    the current stream: a replay runs it only when ``pred`` (a 0-dim bool CUDA tensor) is true at that point of
    the replay. The block's allocations come from the graph's pool, as the rest of the capture's. Outside a
    capture, or with a torch that cannot record conditional nodes, the block runs as it is. Yields whether it is
    conditional."""
    if pred.device.type != "cuda" or not torch.cuda.is_current_stream_capturing() or not conditional_nodes_supported():
        yield False
        return
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    graph.begin_capture_to_if_node(pred)
    try:
        yield True
    finally:
        graph.end_capture_to_conditional_node()


class GraphStore(Generic[E, I]):
    """The captured calls of one worker on one CUDA device: entries by key, least recently used evicted first past
    ``max_graphs``, static inputs shared by shape (dropped with the last entry that reads them), and a switch that
    turns capturing off for good after a failed capture (the caller's calls run eagerly from then on).

    Args:
        device: the calls' device.
        limit_name, limit: the largest call the subclass graphs (its name for the error message), ≥ 1.
        max_graphs: entries kept, ≥ 1.
        what: the calls, for the log (e.g. "a certified layer call").
    """

    def __init__(self, device: torch.device | str, limit_name: str, limit: int, max_graphs: int, what: str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        if limit < 1 or max_graphs < 1:
            raise ValueError(f"{limit_name}={limit}, max_graphs={max_graphs}: both must be ≥ 1")
        self.max_graphs = int(max_graphs)
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: OrderedDict[Hashable, E] = OrderedDict()
        self._inputs: weakref.WeakValueDictionary[Hashable, I] = weakref.WeakValueDictionary()
        self._what = what
        self.captures = 0
        self.replays = 0
        self.disabled: str | None = None  # why a capture failed (then every call runs eagerly)

    def __len__(self) -> int:
        return len(self._graphs)

    def _lookup(self, key: Hashable) -> E | None:
        """The entry of ``key`` (marked most recently used), or None."""
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
        return entry

    def _shared_inputs(self, shape: Hashable, make: Callable[[], I]) -> I:
        """The static inputs of ``shape``, made by ``make`` when no kept entry reads them."""
        inputs = self._inputs.get(shape)
        if inputs is None:
            inputs = self._inputs[shape] = make()
        return inputs

    def _capture(self, call: Callable[[], T], context: AbstractContextManager | None = None,
                 ) -> tuple[torch.cuda.CUDAGraph, T, Any] | None:  # fmt: skip
        """:func:`capture_on_side_stream` in this store's pool; None (capturing turned off, warned) if it failed."""
        try:  # other threads (the metrics' flusher) may go on using CUDA meanwhile
            return capture_on_side_stream(self.device, self.pool, call, context)
        except RuntimeError as err:
            self.disabled = f"{type(err).__name__}: {err}"
            logger.warning("certvllm: capturing %s in a CUDA graph failed (%s); they run eagerly from now on",
                           self._what, self.disabled)  # fmt: skip
            return None

    def _keep(self, key: Hashable, entry: E) -> None:
        """Store a new capture, evicting the least recently used past ``max_graphs``."""
        self._graphs[key] = entry
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
