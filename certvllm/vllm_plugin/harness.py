"""Run an offline vLLM engine in a fresh process and report tokens, timings and metrics as JSON.

Used by the engine tests, ``benchmarks/bench_e2e.py`` and the evaluation suite: one process per
engine keeps runs independent (vLLM spawns its own workers, and each run gets its own
``PROMETHEUS_MULTIPROC_DIR`` so the worker-side ``vllm:cert_*`` metrics can be read back).

    python -m certvllm.vllm_plugin.harness SPEC.json RESULT.json

SPEC: ``{"model": DIR, "kv_cache_dtype": "auto"|"certified", "cert": {...additional_config...},
"engine": {...LLM kwargs...}, "requests": [{"prompt": str | "prompt_token_ids": [...], "max_tokens": n,
"ignore_eos": bool, "prompt_logprobs": bool, "logprobs": bool, "skip_reading_prefix_cache": bool,
"detokenize": bool, "abort_after_tokens": n}], "batch": bool, "repeat": int, "audit_rate": float,
"audit_reference": str, "profile": n}``, or several such groups as ``"phases": [...]``, run one after the other
in the same engine;
``"environment": {VAR: value}`` is set in the process before vLLM is imported. A group's ``"audit_rate"``
sets every worker's audit rate (``Auditor.set_rate``) before the group runs, so rates can be compared inside
one engine, and ``"audit_reference"`` (``"compiled"`` or ``"torch"``, ``Auditor.compiled_reference``) the audit's
exact reference (needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in the engine's environment: vLLM sends the setter
as a function); its phase record then also holds ``"workers"``: each worker's ``{"audited", "threads"}``.
A group's ``"profile": n`` serves it under cProfile and adds ``"profile"`` to its record: the ``n`` functions with the
most own time and the ``n`` with the most time including callees (:func:`profile_summary`; the engine's own work is
in it only with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in ``"environment"``). ``"kernels": n`` records the device's
kernels while it serves (``torch.profiler``, CUDA activity) and adds ``"kernels"``: the phase's total device time and
its ``n`` most expensive kernels (:func:`kernel_summary`; in-process engines only, as above).
RESULT: ``{"outputs": [{"token_ids": [...], "text": str, "prompt_tokens": n, "cached_tokens": n,
"aborted": bool}], "seconds": [...], "init_seconds": s, "metrics": {series: value},
"phases": [{"outputs", "seconds", "metrics", "metrics_before"}, ...], "engine_config": {...}, "log": str}``
(top-level ``outputs`` and ``seconds``: the first phase's, ``metrics``: the last snapshot; ``engine_config``:
the settings the engine ran with as the front end sees them, after vLLM filled in its defaults, e.g.
``max_num_batched_tokens``, ``num_gpu_blocks`` and the *requested* ``cudagraph_mode``, which the worker may
still lower, saying so in ``log``: the process's whole output). A phase's
``metrics`` is a cumulative snapshot taken once the engine is idle after it, ``metrics_before`` the one
before it (for the first phase: after startup), so :func:`phase_deltas` gives what each phase alone added
to every counter. A request with ``"prompt_logprobs": true`` also gets
``"prompt_logprobs": [None, lp_1, ...]``: the log-probability of each actual prompt token given the
tokens before it (vLLM's ``SamplingParams(prompt_logprobs=0)``), ``None`` for the first. vLLM skips the
prefix cache for such requests unless ``"skip_reading_prefix_cache": false``; then only the positions
after the cached prefix are computed, and the earlier entries are ``None`` (pass ``"detokenize": false``:
vLLM would otherwise detokenize the uncomputed entries' token ids). A request with ``"logprobs": true`` gets
``"logprobs": [lp_1, ...]``: the log-probability of each generated token as sampled (vLLM's
``SamplingParams(logprobs=0)``), the finest view two runs' decode steps can be compared at.

A request with ``"abort_after_tokens": n`` is aborted once it has produced ``n`` tokens (at least; the
tokens received by then are its output, with ``"aborted": true``), as vLLM's server aborts the request of
a streaming client that goes away. A phase holding such a request runs through the engine's step loop
instead of ``LLM.generate``. vLLM's KV gauges (``vllm:kv_cache_usage_perc``) are refreshed by the next
engine step only, so give such a phase a request that outlives the aborted ones if its gauges matter.

``run_engine(spec, on_phase=callback)`` streams: after each phase the child appends
``{"phase": i, "outputs", "seconds", "metrics", "metrics_before"}`` to a progress file and the parent calls
``callback(record)`` while the engine keeps running, so a caller can save results phase by phase (the
evaluation suite's resumable runs).
"""

from __future__ import annotations

import contextlib
import cProfile
import enum
import faulthandler
import itertools
import json
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from certvllm.env import PROMETHEUS_DIR, prometheus_dir, scoped

DEFAULT_ENGINE = {"enforce_eager": True, "max_model_len": 2048, "dtype": "bfloat16", "seed": 0}
# the engine process's variables unless run_engine(env=...) says otherwise: 1 GiB of CPU KV pages, no usage
# reports, no hub access (the models are local folders)
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
              "PYTHONFAULTHANDLER": "1"}  # fmt: skip


SUMMED_LABELS = ("model_name", "engine", "rank")
"""Labels a result's metrics are summed over: one engine, every worker rank (``vllm:cert_host_tier_bytes`` is the
node's shadow, ``vllm:cert_page_in_bytes_total`` every rank's page-ins); ``/metrics`` keeps ``rank`` apart."""


def _read_metrics(path: str) -> dict[str, float]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    values: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in SUMMED_LABELS)
            values[f"{sample.name}{{{labels}}}"] = values.get(f"{sample.name}{{{labels}}}", 0.0) + sample.value
    return values


METRIC_FLUSH_S = 0.25  # the worker-side metric flusher's period (certvllm.metrics.prometheus)


def _settled_metrics(path: str, polls: int = 40) -> dict[str, float]:
    """The metrics once the worker's flusher has caught up: two reads two flush periods apart that agree.

    Called while the engine is idle, so every count of the work before it is already queued in the worker;
    a single fixed sleep could cut a phase's counts short on a loaded machine and move them into the next
    phase's delta.
    """
    time.sleep(2 * METRIC_FLUSH_S)
    previous = _read_metrics(path)
    for _ in range(polls):
        time.sleep(2 * METRIC_FLUSH_S)
        current = _read_metrics(path)
        if current == previous:
            return current
        previous = current
    return previous


def metric_delta(phase: dict[str, Any]) -> dict[str, float]:
    """What one phase (a result's or a streamed record) added to every series: its snapshot minus the one
    before it. Meaningful for counters and histograms; a gauge is read from the phase's ``metrics``."""
    before = phase["metrics_before"]
    return {k: v - before.get(k, 0.0) for k, v in phase["metrics"].items()}


def phase_deltas(result: dict[str, Any]) -> list[dict[str, float]]:
    """:func:`metric_delta` of every phase of ``result``."""
    return [metric_delta(phase) for phase in result["phases"]]


def greedy_agreement(reference: list[list[int]], candidate: list[list[int]]) -> dict[str, int]:
    """How far two runs' greedy outputs of the same requests agree: ``identical`` of ``outputs`` are equal
    token for token, and ``tokens_in_place`` of the reference's ``tokens`` equal the candidate's token at the
    same position (a first differing token usually changes everything after it)."""
    pairs = list(zip(reference, candidate, strict=True))
    return {
        "outputs": len(pairs),
        "identical": sum(a == b for a, b in pairs),
        "tokens_in_place": sum(sum(x == y for x, y in zip(a, b, strict=False)) for a, b in pairs),
        "tokens": sum(len(a) for a, _ in pairs),
    }


def _set_audit_rate(worker: Any, rate: float, reference: str | None = None) -> dict[str, int]:
    """In a worker (``LLM.collective_rpc``): audit with probability ``rate`` from now on, with the exact reference
    ``reference`` (``"compiled"``, ``"torch"``; None: unchanged); returns the head-steps audited so far and the
    worker's torch threads."""
    import torch

    from certvllm.vllm_plugin.runtime import WorkerRuntime

    runtime = WorkerRuntime.current()
    if runtime is None:
        raise RuntimeError("certvllm: no certified runtime in this worker (--kv-cache-dtype certified?)")
    runtime.audit.set_rate(rate)
    if reference is not None:
        runtime.audit.compiled_reference = {"compiled": True, "torch": False}[reference]
    return {"audited": runtime.audit.audited, "threads": torch.get_num_threads()}


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    engine = {**DEFAULT_ENGINE, **spec.get("engine", {})}
    if spec.get("cert") is not None:
        engine["additional_config"] = {"certvllm": spec["cert"]}
    start = time.perf_counter()
    llm = LLM(spec["model"], kv_cache_dtype=spec.get("kv_cache_dtype", "auto"), disable_log_stats=False, **engine)
    init = time.perf_counter() - start
    metrics_dir = prometheus_dir()
    if not metrics_dir:
        raise RuntimeError("PROMETHEUS_MULTIPROC_DIR is not set: start the harness with run_engine")
    before = _settled_metrics(metrics_dir)  # startup's own counts belong to no phase

    def params(r: dict[str, Any]) -> Any:
        return SamplingParams(
            max_tokens=r.get("max_tokens", 32), temperature=0.0, ignore_eos=r.get("ignore_eos", False),
            prompt_logprobs=0 if r.get("prompt_logprobs") else None, logprobs=0 if r.get("logprobs") else None,
            skip_reading_prefix_cache=r.get("skip_reading_prefix_cache"), detokenize=r.get("detokenize", True),
        )  # fmt: skip

    def prompt_logprobs(o: Any) -> list[float | None]:
        return align_prompt_logprobs(list(o.prompt_token_ids or []), list(o.prompt_logprobs or []),
                                     o.num_cached_tokens or 0)  # fmt: skip

    def prompt(r: dict[str, Any]) -> Any:
        return {"prompt_token_ids": r["prompt_token_ids"]} if "prompt_token_ids" in r else r["prompt"]

    request_ids = itertools.count()

    def stream(requests: list[dict[str, Any]]) -> tuple[list[Any], set[str]]:
        """Serve ``requests`` through the engine's step loop (what ``LLM.generate`` runs), aborting each
        request with ``abort_after_tokens`` once it has that many tokens. Returns the last output of every
        request, in order, and the ids of the aborted ones."""
        engine = llm.llm_engine
        ids = [f"harness-{next(request_ids)}" for _ in requests]
        limits = {rid: r.get("abort_after_tokens") for rid, r in zip(ids, requests, strict=True)}
        for rid, r in zip(ids, requests, strict=True):
            engine.add_request(rid, prompt(r), params(r))
        last: dict[str, Any] = {}
        aborted: set[str] = set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id not in limits or out.request_id in aborted:
                    continue  # an aborted request's output still in flight
                last[out.request_id] = out
                limit = limits[out.request_id]
                if not out.finished and limit is not None and len(out.outputs[0].token_ids) >= limit:
                    engine.abort_request([out.request_id])
                    aborted.add(out.request_id)
        return [last[rid] for rid in ids], aborted

    def run_phase(phase: dict[str, Any]) -> dict[str, Any]:
        requests = phase["requests"]
        streamed = any(r.get("abort_after_tokens") is not None for r in requests)

        def serve(group: list[dict[str, Any]]) -> tuple[list[Any], set[str]]:
            if streamed:
                return stream(group)
            return llm.generate([prompt(r) for r in group], [params(r) for r in group], use_tqdm=False), set()

        workers = None
        if phase.get("audit_rate") is not None:
            workers = llm.collective_rpc(_set_audit_rate,
                                         args=(float(phase["audit_rate"]), phase.get("audit_reference")))  # fmt: skip
        seconds, outputs = [], []
        profiler = cProfile.Profile() if phase.get("profile") else None
        kernels = kernel_profiler() if phase.get("kernels") else None
        for _ in range(phase.get("repeat", 1)):
            got, aborted = [], set()
            for group in [requests] if phase.get("batch", True) else [[r] for r in requests]:
                t = time.perf_counter()
                with profiler or contextlib.nullcontext(), kernels or contextlib.nullcontext():
                    outs, cut = serve(group)
                seconds.append(time.perf_counter() - t)
                got += outs
                aborted |= cut
            outputs = [{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                        "prompt_tokens": len(o.prompt_token_ids or []),
                        "cached_tokens": o.num_cached_tokens or 0,
                        "aborted": o.request_id in aborted} for o in got]  # fmt: skip
            for out, r, o in zip(outputs, requests, got, strict=True):
                if r.get("prompt_logprobs"):
                    out["prompt_logprobs"] = prompt_logprobs(o)
                if r.get("logprobs"):
                    sample = o.outputs[0]
                    out["logprobs"] = [float(lp[t].logprob) for t, lp in zip(sample.token_ids, sample.logprobs or [],
                                                                            strict=True)]  # fmt: skip
        record: dict[str, Any] = {"outputs": outputs, "seconds": seconds}
        if workers is not None:
            record["workers"] = workers
        if profiler is not None:
            record["profile"] = profile_summary(profiler, int(phase["profile"]))
        if kernels is not None:
            record["kernels"] = kernel_summary(kernels, int(phase["kernels"]))
        return record

    progress = spec.get("progress")
    engine_config = _engine_config(llm)
    phases = []
    for i, phase in enumerate(spec.get("phases", [spec])):
        record = run_phase(phase)
        record["metrics"], record["metrics_before"] = _settled_metrics(metrics_dir), before
        before = record["metrics"]
        phases.append(record)
        if progress:  # stream this phase with its metrics snapshot
            with open(progress, "a") as f:
                f.write(json.dumps({"phase": i, **record}) + "\n")
    _shutdown(llm)
    return {"outputs": phases[0]["outputs"], "seconds": phases[0]["seconds"], "phases": phases,
            "init_seconds": init, "metrics": before, "engine_config": engine_config}  # fmt: skip


def _short_path(path: str) -> str:
    """A profiled function's file as a package-relative path (``vllm/...``, ``certvllm/...``, ``torch/...``)."""
    for marker in ("site-packages/", "dist-packages/", "/certvllm-src/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def profile_summary(profiler: cProfile.Profile, top: int) -> dict[str, list[dict[str, Any]]]:
    """The ``top`` functions of a profiled phase by own time (``tottime``) and by time including callees
    (``cumtime``): ``{"tottime": [...], "cumtime": [...]}``, each entry ``{"function", "calls", "tottime",
    "cumtime"}`` (seconds over the whole phase). The engine core and its worker are in it only when the engine runs
    in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). From Python 3.12 cProfile records every thread of the process
    (it is built on ``sys.monitoring``), so the metrics' flusher thread is in it too; before 3.12, the serving
    thread only."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # (file, line, name) → (cc, nc, tt, ct, callers)
    rows = [
        {"function": f"{_short_path(file)}:{line}({name})", "calls": nc, "tottime": tt, "cumtime": ct}
        for (file, line, name), (_cc, nc, tt, ct, _callers) in stats.items()
    ]
    return {key: sorted(rows, key=lambda r: -r[key])[:top] for key in ("tottime", "cumtime")}


def kernel_profiler() -> Any:
    """A ``torch.profiler`` session recording the device's kernels (CUDA activity only: no host-side events, so the
    serving thread is barely slowed); enter it around the work to record. Kernels replayed from CUDA graphs are
    recorded too."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA])


def kernel_summary(prof: Any, top: int) -> dict[str, Any]:
    """The device time of a recorded phase: ``{"total_us", "launches", "kernels": [...]}``, the ``top`` kernels by
    device time, each ``{"kernel", "launches", "total_us", "launch_us"}`` (microseconds over the whole phase; the
    kernel names as the driver reports them, truncated to 160 characters; ``launch_us``: the median, 90th percentile
    and largest time of one launch, which tell a kernel's common launch from its rare long ones, such as the
    promotion pass's from the exact re-run of escalated groups under the same name)."""
    launches: dict[str, list[float]] = {}
    for event in prof.events():
        if "cuda" in str(getattr(event, "device_type", "")).lower():
            launches.setdefault(event.name[:160], []).append(float(getattr(event, "device_time", 0.0) or 0.0))
    rows = []
    for event in prof.key_averages():
        total = float(getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0) or 0.0)
        if total <= 0.0 or getattr(event, "device_type", None) is None:
            continue
        if "cuda" not in str(event.device_type).lower():
            continue
        row = {"kernel": event.key[:160], "launches": int(event.count), "total_us": round(total, 1)}
        times = sorted(launches.get(event.key[:160], ()))
        if times:
            row["launch_us"] = {"p50": round(times[len(times) // 2], 1), "p90": round(times[(9 * len(times)) // 10], 1),
                                "max": round(times[-1], 1)}  # fmt: skip
        rows.append(row)
    rows.sort(key=lambda r: -r["total_us"])
    return {"total_us": round(sum(r["total_us"] for r in rows), 1), "launches": sum(r["launches"] for r in rows),
            "kernels": rows[:top]}  # fmt: skip


def _shutdown(llm: Any) -> None:
    """Stop the engine's processes once every phase is recorded. vLLM's teardown walks the process tree with psutil
    and fails when a worker exits between the listing and the read of its ``/proc`` entry (seen with two CPU
    workers: ``FileNotFoundError: /proc/PID/stat``); a process that is already gone is what the teardown wanted,
    so that race is logged and the finished run kept."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as err:
        # psutil names the race NoSuchProcess (psutil is not imported here), the OS ProcessLookupError or a missing
        # /proc file; anything else is a real failure
        gone = isinstance(err, (ProcessLookupError, FileNotFoundError)) or type(err).__name__ == "NoSuchProcess"
        if not gone:
            raise
        print(f"harness: engine teardown raced with a worker's exit ({type(err).__name__}: {err}); results kept",
              file=sys.stderr)  # fmt: skip


def _engine_config(llm: Any) -> dict[str, Any]:
    """The settings an engine runs with, as the front end's ``VllmConfig`` holds them once the engine is up
    (vLLM's defaults filled in; enums as their names). ``cudagraph_mode`` is the requested mode: the worker
    lowers it when the attention backend cannot be captured, and logs that."""
    config = llm.llm_engine.vllm_config
    fields = {
        "max_model_len": (config.model_config, "max_model_len"),
        "enforce_eager": (config.model_config, "enforce_eager"),
        "block_size": (config.cache_config, "block_size"),
        "num_gpu_blocks": (config.cache_config, "num_gpu_blocks"),
        "enable_prefix_caching": (config.cache_config, "enable_prefix_caching"),
        "max_num_batched_tokens": (config.scheduler_config, "max_num_batched_tokens"),
        "max_num_seqs": (config.scheduler_config, "max_num_seqs"),
        "enable_chunked_prefill": (config.scheduler_config, "enable_chunked_prefill"),
        "compilation_mode": (config.compilation_config, "mode"),
        "cudagraph_mode": (config.compilation_config, "cudagraph_mode"),
    }
    values: dict[str, Any] = {}
    for name, (section, attr) in fields.items():
        value = getattr(section, attr, None)
        if isinstance(value, enum.Enum):
            value = value.name
        values[name] = value if value is None or isinstance(value, bool | int | float | str) else str(value)
    return values


def align_prompt_logprobs(ids: list[int], per_pos: list[Any], cached: int) -> list[float | None]:
    """The log-probability of each actual prompt token, one entry per prompt position (``None`` where none was
    computed), from vLLM's ``RequestOutput.prompt_logprobs`` (per position: ``None`` or a dict token id →
    ``Logprob``, which also holds the top-0 entries).

    With a prefix-cache hit of ``cached`` tokens, rows 0..cached-1 are not computed, so positions 1..cached have no
    log-probability. vLLM 0.32 returns a list as long as the prompt (those positions ``None``); vLLM 0.26 returns
    only the computed positions after its leading ``None`` (``1 + len(ids) - cached - 1`` entries). Both end at
    the prompt's last position, so a shorter list is aligned to the end (vLLM 0.26's model runner V2 concatenates
    the computed chunks' rows). Each computed position's entry holds its own prompt token (``prompt_logprobs=0``
    returns exactly that one); an entry without it means the alignment is wrong, and that is an error, never a
    silently shifted perplexity."""
    if len(per_pos) > len(ids):
        raise ValueError(f"{len(per_pos)} prompt log-probability entries for a {len(ids)}-token prompt")
    per_pos = [None] * (len(ids) - len(per_pos)) + per_pos
    out: list[float | None] = []
    for i, lp in enumerate(per_pos):
        if lp is None or i <= cached:
            out.append(None)
        elif ids[i] not in lp:
            raise ValueError(
                f"prompt log-probabilities misaligned: position {i} holds tokens {sorted(lp)[:4]}, not the "
                f"prompt's token {ids[i]} ({len(per_pos)} positions, {cached} cached)"
            )
        else:
            out.append(float(lp[ids[i]].logprob))
    return out


def cpu_binds(engines: int) -> list[str | None]:
    """``VLLM_CPU_OMP_THREADS_BIND`` values for up to ``engines`` CPU engines run at the same time.

    vLLM's own binding puts every engine's worker threads on the same cores, so engines run side by side
    need disjoint core sets; they get equal ones, so that each computes with the same thread count (and
    so the same numbers) as the others. One entry per engine that can run at once: ``[None]`` (vLLM's own
    binding) for a single engine or a single core.
    """
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    n = max(1, min(engines, len(cores)))
    if n == 1:
        return [None]
    per = len(cores) // n
    return [",".join(str(c) for c in cores[i * per : (i + 1) * per]) for i in range(n)]


ENGINE_DEATH = ("engine core exited unexpectedly", "EngineDeadError", "terminate called after throwing")
"""Log lines of a dead engine core. vLLM's client can then wait forever for outputs that will not come (seen
on the H200: an illegal memory access in the engine core left the harness blocked until the lease's timeout),
so the run is ended :data:`DEATH_GRACE_S` after one appears."""
DEATH_GRACE_S = 15.0


def _engine_died(log: Path, offset: int) -> tuple[bool, int]:
    """Whether the log past ``offset`` holds an :data:`ENGINE_DEATH` line; the new offset."""
    with log.open("rb") as f:
        f.seek(max(0, offset - 200))  # a marker split across two reads
        text = f.read().decode(errors="replace")
        return any(marker in text for marker in ENGINE_DEATH), f.tell()


STALL_DUMP_GRACE_S = 15.0
"""How long a stalled run's processes get to write their stacks (``SIGABRT`` under ``PYTHONFAULTHANDLER``)."""


def _follow(proc: subprocess.Popen, progress: Path, on_phase: Callable[[dict[str, Any]], None], timeout: float,
            log: Path | None = None, stall_timeout: float | None = None) -> int:  # fmt: skip
    """Wait for ``proc``, handing every complete line appended to ``progress`` to ``on_phase``; with ``log``, end
    it once the engine core has died (:data:`ENGINE_DEATH`) and the process has not exited within the grace.

    With ``stall_timeout``, a run that finishes no phase for that many seconds (startup included) is stopped
    with ``SIGABRT`` to its whole session: every Python process of the engine then writes all its threads' stacks
    to the log (``PYTHONFAULTHANDLER``, set by :data:`ENGINE_ENV`), which the error carries; a hang is a
    diagnosable failure, never a run that waits until the overall ``timeout``."""
    deadline, offset, log_offset, died_at = time.monotonic() + timeout, 0, 0, None
    last_phase = time.monotonic()

    def drain() -> None:
        nonlocal offset, last_phase
        if not progress.exists():
            return
        with progress.open() as f:
            f.seek(offset)
            while (line := f.readline()).endswith("\n"):
                offset = f.tell()
                last_phase = time.monotonic()
                on_phase(json.loads(line))

    restore = _raise_on_sigterm()
    try:
        while True:
            try:
                code = proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                drain()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the run's time limit ({timeout:.0f} s) was reached") from None
                if log is not None and died_at is None:
                    died, log_offset = _engine_died(log, log_offset)
                    died_at = time.monotonic() if died else None
                if died_at is not None and time.monotonic() - died_at > DEATH_GRACE_S:
                    grace = f"{DEATH_GRACE_S:.0f} s"
                    raise RuntimeError(f"the engine core died and the run did not exit within {grace}") from None
                if stall_timeout is not None and time.monotonic() - last_phase > stall_timeout:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGABRT)  # each process dumps its stacks, then dies
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=STALL_DUMP_GRACE_S)
                    raise RuntimeError(
                        f"no phase finished for {stall_timeout:.0f} s: the engine was stopped with SIGABRT; its "
                        "processes' Python stacks are in the log below"
                    ) from None
                continue
            drain()
            return code
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine and its workers share the child's session
        proc.wait()
        raise
    finally:
        restore()


class Terminated(SystemExit):
    """This process got ``SIGTERM`` (``timeout``, a job scheduler) while it followed an engine run."""


def _raise_on_sigterm() -> Callable[[], None]:
    """While a run is followed, ``SIGTERM`` raises :class:`Terminated` here instead of ending the process at once,
    so that :func:`_follow` stops the engine's session first: the engine runs in its own session and would
    otherwise outlive its parent, holding its GPU memory (found on the H200: a benchmark cut by ``timeout``
    left an engine core holding 57 GiB, and the next engine could not start). Only in the main thread, and
    only where no other handler is installed. Returns the function that restores the previous handler."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    if not in_main_thread or signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return lambda: None

    def terminated(signum: int, frame: Any) -> None:
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    return lambda: signal.signal(signal.SIGTERM, previous)


def first_errors(log_text: str, lines: int = 40) -> str:
    """The log from its first error line on (``lines`` lines), for a failure whose tail shows only the
    shutdown it caused (a worker that died first leaves its reason far above the engine core's teardown)."""
    log = log_text.splitlines()
    first = next((i for i, line in enumerate(log) if "Traceback" in line or " ERROR " in line), None)
    if first is None or len("\n".join(log[first:])) <= 6000:
        return ""
    return "first error lines:\n" + "\n".join(log[first : first + lines]) + "\n...\nlog tail:\n"


def run_engine(
    spec: dict[str, Any], timeout: float = 900.0, env: dict[str, str] | None = None,
    on_phase: Callable[[dict[str, Any]], None] | None = None, stall_timeout: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run ``spec`` in a fresh Python process; raises RuntimeError with the log tail on failure.

    The process inherits this one's environment with :data:`ENGINE_ENV`, then ``env``, set on top (the
    child sets them before it imports vLLM), and its own ``PROMETHEUS_MULTIPROC_DIR``. With ``on_phase``,
    each finished phase is handed over as soon as the engine completes it (see the module docstring);
    ``timeout`` then bounds the whole run as well, and ``stall_timeout`` the wait for each phase (see
    :func:`_follow`: a stalled engine is stopped with its stacks in the error).
    """
    with tempfile.TemporaryDirectory(prefix="certvllm-harness-") as tmp:
        spec_path, out_path, log_path = Path(tmp, "spec.json"), Path(tmp, "out.json"), Path(tmp, "log.txt")
        if on_phase is not None:
            spec = {**spec, "progress": str(Path(tmp, "progress.jsonl"))}
        spec = {**spec, "environment": {**ENGINE_ENV, **(env or {}), PROMETHEUS_DIR: str(Path(tmp, "metrics"))}}
        spec_path.write_text(json.dumps(spec))
        Path(tmp, "metrics").mkdir()
        # -P: the current directory stays off the child's sys.path (run from a source checkout, the top-level
        # triton_kernels/ would shadow vLLM's own module; certvllm is imported as installed)
        command = [sys.executable, "-P", "-m", "certvllm.vllm_plugin.harness", str(spec_path), str(out_path)]
        with log_path.open("w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                returncode = _follow(proc, Path(spec.get("progress", Path(tmp, "progress.jsonl"))),
                                     on_phase or (lambda _: None), timeout, log_path, stall_timeout)  # fmt: skip
            except RuntimeError as err:
                tail = 20000 if "SIGABRT" in str(err) else 6000  # the stacks of every thread of every process
                raise RuntimeError(f"engine run failed ({err}):\n{log_path.read_text()[-tail:]}") from None
        log_text = log_path.read_text()
        if returncode != 0 or not out_path.exists():
            raise RuntimeError(f"engine run failed (exit {returncode}):\n{first_errors(log_text)}{log_text[-6000:]}")
        result = json.loads(out_path.read_text())
        result["log"] = log_text
        capacity = re.search(r"KV cache size: ([\d,]+) tokens", log_text)
        result["kv_cache_tokens"] = int(capacity.group(1).replace(",", "")) if capacity else None
        return result


def main() -> None:
    faulthandler.enable()  # this process's stacks on SIGABRT (a stalled run); its children get PYTHONFAULTHANDLER
    spec = json.loads(Path(sys.argv[1]).read_text())
    with contextlib.ExitStack() as stack:  # before vLLM (and prometheus_client) is imported
        for name, value in spec.get("environment", {}).items():
            stack.enter_context(scoped(name, value))
        result = _run(spec)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
