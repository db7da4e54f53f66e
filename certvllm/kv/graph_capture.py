"""Capturing one call into a CUDA graph on a side stream, as certvllm's graphed calls do (the certified layer
calls of ``certvllm.attention.graphs``, the device write path of ``certvllm.kv.write_graphs``).

``torch.cuda.graph`` synchronises the device and collects garbage around every capture; these captures happen
while a vLLM step is running and while the metrics' flusher thread uses CUDA, so they are taken on a side stream
that waits for the current one, in ``thread_local`` capture mode (other threads' CUDA calls are not captured and
do not break the capture), and the current stream waits for the side stream afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch

T = TypeVar("T")


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
