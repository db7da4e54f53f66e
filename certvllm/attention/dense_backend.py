"""Which kernel computes exact dense decode attention (rungs 3/4 and the dense mode).

Every kernel here takes one query per head and returns the same quantity:

    q ``[H_q, D]``, k and v ``[T, H_kv, D]`` (the float16/bfloat16 originals, any float dtype works)
    → ``[H_q, D]`` float32, attention computed in float32 from float32 copies of the inputs.

Query head ``h`` reads KV head ``h // (H_q // H_kv)`` (grouped-query attention, as SDPA's ``enable_gqa``).

Backends:

* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` in its ``[B, H, M, K]`` layout with
  ``enable_gqa``;
* ``"xformers"``: ``xformers.ops.memory_efficient_attention`` in its grouped ``[B, M, G, H, K]`` layout
  (the KV heads as groups, broadcast with stride 0 over their query heads: no expanded copy). Only on CUDA,
  and only where xformers is installed (``pip install 'certvllm[xformers]'``); never required.

Selection, from ``CertConfig.dense_backend`` (``--cert-dense-backend``; every function here takes it as
``backend``):

* ``sdpa``: always SDPA;
* ``xformers``: always xformers; a ``RuntimeError`` with the fix when it cannot be imported or the
  tensors are not on CUDA;
* ``auto``: SDPA on the CPU or when xformers cannot be imported. On CUDA with xformers importable, the
  first call of each shape class ``(device, dtype, H_q, H_kv, D, T rounded up to a power of two)``
  times both kernels on that call's inputs (``WARM_RUNS`` untimed, then the median of ``TIMED_RUNS``)
  and compares their outputs (``torch.allclose`` with ``AGREE_RTOL`` and ``AGREE_ATOL``·max(1, max|v|),
  float32). xformers is chosen only if it is faster *and* agrees; the decision is cached for the rest
  of the process and logged once at INFO. Inside CUDA graph capture nothing is timed: the cached
  decision is used, else SDPA (which is then cached for that class, so the class never changes kernel).

Because the decision is per shape class and cached, every call of a class (``dense_decode``, and the
reference and CPU paths' rung-3/4 recompute ``dense_paged``) uses the same kernel on the same originals:
a head recomputed there stays bit-identical to ``dense_decode``.
"""

from __future__ import annotations

import importlib
import logging
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger("certvllm")

BACKENDS = ("auto", "sdpa", "xformers")
FLAG = "--cert-dense-backend"
WARM_RUNS = 3
TIMED_RUNS = 5
AGREE_RTOL = 1e-4
AGREE_ATOL = 1e-4
"""Absolute tolerance per unit of max|v| (outputs are convex combinations of value rows)."""

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
ShapeClass = tuple[str, torch.dtype, int, int, int, int]

_clock: Callable[[], float] = time.perf_counter  # the timer of the measurement (tests substitute theirs)
_decisions: dict[ShapeClass, str] = {}
_forced_logged: set[str] = set()
_xformers: tuple[Callable[..., torch.Tensor] | None, str] | None = None  # (memory_efficient_attention, why not)


def check_request(backend: str, on_cuda: bool, where: str = "this platform") -> str:
    """Validate a requested backend before serving (the vLLM plugin calls this at startup, so that a forced
    ``xformers`` that cannot run fails there and not at the first rung-3/4 event). Returns ``backend``;
    raises with the fix."""
    if backend not in BACKENDS:
        raise ValueError(f"dense backend {backend!r}: choose one of {', '.join(BACKENDS)} ({FLAG})")
    if backend == "xformers":
        attention, why = xformers_attention()
        if attention is None:
            raise RuntimeError(
                f"{FLAG} xformers, but xformers cannot be imported ({why}): install it with "
                f"pip install 'certvllm[xformers]' (CUDA machines only) or use {FLAG} sdpa (or auto)"
            )
        if not on_cuda:
            raise RuntimeError(
                f"{FLAG} xformers, but {where} is not CUDA: xformers runs on CUDA only; use {FLAG} auto "
                "(SDPA off CUDA) or sdpa"
            )
    return backend


def xformers_attention() -> tuple[Callable[..., torch.Tensor] | None, str]:
    """``xformers.ops.memory_efficient_attention`` and ``""``, or ``None`` and why it cannot be imported.

    The import is tried once per process (:func:`reset` forgets the result)."""
    global _xformers
    if _xformers is None:
        try:
            _xformers = (importlib.import_module("xformers.ops").memory_efficient_attention, "")
        except Exception as exc:  # ImportError, or a build that fails to load its CUDA libraries
            _xformers = (None, f"{type(exc).__name__}: {exc}")
    return _xformers


def xformers_device_ok(device: torch.device) -> bool:
    """Whether xformers' kernels can run on ``device``: CUDA only."""
    return device.type == "cuda"


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (never on a CPU device or a CPU-only build)."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Torch SDPA, float32: q ``[H_q, D]``, k/v ``[T, H_kv, D]`` → ``[H_q, D]`` float32."""
    qf = q.float().unsqueeze(0).unsqueeze(2)  # (1, H_q, 1, D)
    kf = k.float().permute(1, 0, 2).unsqueeze(0)  # (1, H_kv, T, D)
    vf = v.float().permute(1, 0, 2).unsqueeze(0)
    out = F.scaled_dot_product_attention(qf, kf, vf, scale=scale, enable_gqa=kf.shape[1] != qf.shape[1])
    return out[0, :, 0]


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[T, H_kv, D]`` → ``[1, T, H_kv, G, D]`` float32: the KV heads broadcast over their ``G`` query
    heads with stride 0 (xformers' grouped ``[B, M, G, H, K]`` form; no copy beyond the float conversion)."""
    T, h_kv, D = x.shape
    return x.float().view(1, T, h_kv, 1, D).expand(1, T, h_kv, group, D)


def xformers_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """xformers' memory-efficient attention, float32: same arguments and result as :func:`sdpa_decode`.
    Grouped form: query head ``j·G + g`` is ``[.., j, g, :]`` and reads KV head ``j``."""
    attention, why = xformers_attention()
    if attention is None:
        raise RuntimeError(f"xformers cannot be imported ({why})")
    h_q, D = q.shape
    group = h_q // k.shape[1]
    qf = q.float().reshape(1, 1, k.shape[1], group, D)  # (B=1, M=1, G=H_kv, H=group, K=D)
    out = attention(qf, _grouped(k, group), _grouped(v, group), scale=scale)
    return out.reshape(h_q, D)


KERNELS: dict[str, Kernel] = {"sdpa": sdpa_decode, "xformers": xformers_decode}


def shape_class(q: torch.Tensor, k: torch.Tensor) -> ShapeClass:
    """``(device, dtype, H_q, H_kv, D, T rounded up to a power of two)``: one decision each."""
    T = max(1, k.shape[0])
    return (str(k.device), k.dtype, q.shape[0], k.shape[1], k.shape[2], 1 << (T - 1).bit_length())


def _median_seconds(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda *_: None
    for _ in range(WARM_RUNS):
        fn()
    sync(device)
    times = []
    for _ in range(TIMED_RUNS):
        t0 = _clock()
        fn()
        sync(device)
        times.append(_clock() - t0)
    return statistics.median(times)


def _measure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[str, str]:
    """Time both kernels on these inputs and check that they agree: ``(choice, why)``."""
    run = lambda name: lambda: KERNELS[name](q, k, v, scale)  # noqa: E731
    try:
        t_sdpa = _median_seconds(run("sdpa"), k.device)
        t_xf = _median_seconds(run("xformers"), k.device)
        ref, alt = KERNELS["sdpa"](q, k, v, scale), KERNELS["xformers"](q, k, v, scale)
    except Exception as exc:  # an xformers build without a kernel for this shape/dtype/GPU
        return "sdpa", f"xformers failed ({type(exc).__name__}: {exc})"
    atol = AGREE_ATOL * max(1.0, float(v.float().abs().max()))
    timing = f"sdpa {t_sdpa * 1e6:.1f} µs, xformers {t_xf * 1e6:.1f} µs"
    if alt.shape != ref.shape or not torch.allclose(alt.float(), ref.float(), rtol=AGREE_RTOL, atol=atol):
        return "sdpa", f"xformers disagrees with sdpa beyond rtol={AGREE_RTOL:g}, atol={atol:g} ({timing})"
    if t_xf < t_sdpa:
        return "xformers", f"faster and agrees ({timing})"
    return "sdpa", f"xformers not faster ({timing})"


def choose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str = "auto") -> str:
    """The kernel (``"sdpa"`` or ``"xformers"``) for these inputs and the requested ``backend``, by the rule
    of the module docstring."""
    want = check_request(backend, xformers_device_ok(k.device), f"the tensors' device {k.device}")
    if want == "sdpa":
        return "sdpa"
    if want == "xformers":
        if "xformers" not in _forced_logged:
            _forced_logged.add("xformers")
            logger.info("certvllm: exact dense attention uses xformers (%s xformers)", FLAG)
        return "xformers"

    if not xformers_device_ok(k.device) or xformers_attention()[0] is None:
        return "sdpa"
    key = shape_class(q, k)
    choice = _decisions.get(key)
    if choice is not None:
        return choice
    if capturing(k.device):
        choice, why = "sdpa", "chosen during CUDA graph capture, not timed"
    else:
        choice, why = _measure(q, k, v, scale)
    _decisions[key] = choice
    logger.info("certvllm: exact dense attention for %s uses %s: %s", key, choice, why)
    return choice


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str = "auto") -> torch.Tensor:
    """Exact dense decode attention with the kernel :func:`choose` picks: ``[H_q, D]`` float32."""
    return KERNELS[choose(q, k, v, scale, backend)](q, k, v, scale)


def decisions() -> dict[ShapeClass, str]:
    """A copy of the cached ``auto`` decisions, by shape class."""
    return dict(_decisions)


def reset() -> None:
    """Forget the cached decisions and the xformers import result (tests; after installing xformers)."""
    global _xformers
    _decisions.clear()
    _forced_logged.clear()
    _xformers = None
