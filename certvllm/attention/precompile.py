"""The warm-up's compiles spread over child processes: each compiles some shape classes into the shared disk cache.

Triton compiles a kernel variant on one CPU core (the front end, LLVM and ``ptxas``), and the warm-up of a
128K server meets about a hundred variants (``certvllm.attention.warmup``: 116 s on a fresh H200 machine). The
variants of different shape classes are independent, so :func:`precompile` starts ``n`` child processes
(``python -m certvllm.attention.precompile``), each building the warm-up's synthetic layer on the same device and
running its share of the classes (:func:`partition`, widest classes first: a class's compile time grows with its
``BP``). They compile into certvllm's Triton disk cache (``certvllm.env.triton_cache_scope``, inherited through
``TRITON_CACHE_DIR``); the serial warm-up that follows in the server's process then loads every variant from that
cache (0.7 s for 71 variants on the H200) and stays the one that vouches for the compile: a child that fails, is
killed or times out costs only its time, and whatever it did not compile the serial pass compiles.

Children are plain subprocesses (not ``multiprocessing``), so that a daemonic vLLM worker process can start them;
the job goes in on stdin and the result comes back as one JSON line on stdout.

A child compiles with the ``ptxas`` whose version the server process's compile hashes hold
(:func:`children_ptxas`). Triton reads that version once per process, and inside vLLM it reads it before torch's
inductor points ``TRITON_PTXAS_PATH`` at torch's own ``ptxas``: the server's hashes then name Triton's bundled
``ptxas`` (CUDA 12.8 with Triton 3.6) while children started later, inheriting the variable, would name torch's
(13.0), and the serial pass would find none of their variants (measured on the H100: 121 of 121 compiled again).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from certvllm.attention.synthetic import SyntheticLayer
from certvllm.config import CertConfig
from certvllm.env import child_environment, triton_ptxas_path, triton_tool_paths
from certvllm.triton_kernels import jit_cache
from certvllm.triton_kernels.jit_cache import Variant

logger = logging.getLogger("vllm.certvllm")

MAX_WORKERS = 8
"""Most child processes :func:`plan_workers` picks by itself."""
WORKER_DEVICE_BYTES = 2 << 30
"""Free device memory asked of each child (its CUDA context, the synthetic layer and the kernels' workspaces)."""
TIMEOUT_S = 900.0
"""The children's deadline: past it they are killed and the serial pass compiles what they did not."""


@dataclass(frozen=True)
class LayerSpec:
    """What a child needs to build the warm-up's synthetic layer and enumerate the server's shape classes
    (``warmup.warm_up``'s arguments), as JSON."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float16" | "bfloat16"
    max_model_len: int
    max_num_seqs: int
    config: dict[str, Any]  # CertConfig.model_dump(mode="json")
    device: str
    block_size_tokens: int
    scale: float | None

    def describe(self) -> str:
        """The head layout as error messages name it: ``H_q=32, H_kv=8, D=128, bfloat16``."""
        return f"H_q={self.num_q_heads}, H_kv={self.num_kv_heads}, D={self.head_dim}, {self.dtype}"

    def make_layer(self, config: CertConfig) -> SyntheticLayer:
        """The warm-up's synthetic layer of this layout on this device."""
        return SyntheticLayer(self.num_q_heads, self.num_kv_heads, self.head_dim, getattr(torch, self.dtype), config,
                              self.device, block_size_tokens=self.block_size_tokens, scale=self.scale)  # fmt: skip


@dataclass(frozen=True)
class PrecompileReport:
    """What :func:`precompile` did: ``workers`` children, ``seconds`` of wall time, ``compilations`` they made
    (the sum of their counts), ``note``: why some or all of them failed (empty when none did), ``variants``: the
    variants the children hold (``jit_cache.variant_keys`` of each; empty under the interpreter)."""

    workers: int = 0
    seconds: float = 0.0
    compilations: int = 0
    note: str = ""
    variants: frozenset[Variant] = frozenset()
    backend: str = ""  # the children's :func:`compiler_fingerprint` (the first child's)

    def summary(self) -> str:
        """A clause of the warm-up's log line."""
        text = f"{self.workers} processes compiled {self.compilations} variants in {self.seconds:.1f} s"
        return text + (f" ({self.note})" if self.note else "")


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def plan_workers(config: CertConfig, num_classes: int, device: torch.device) -> int:
    """Children for :func:`precompile`: ``config.warmup_workers`` when set, else one per two CPUs this process may
    run on, at most :data:`MAX_WORKERS`; never more than the classes, nor than free device memory allows
    (:data:`WORKER_DEVICE_BYTES` each). 0 when fewer than 2 would run (the serial warm-up alone)."""
    n = config.warmup_workers if config.warmup_workers is not None else min(MAX_WORKERS, _cpus() // 2)
    n = min(n, num_classes)
    if device.type == "cuda" and n >= 2:
        free, _ = torch.cuda.mem_get_info(device)
        n = min(n, free // WORKER_DEVICE_BYTES)
    return int(n) if n >= 2 else 0


def partition(costs: list[int], n: int) -> list[list[int]]:
    """Indices of ``costs`` in ``n`` non-empty groups of near-equal total cost: the largest first, each to the group
    with the least so far (ties to the lower group). ``n`` ≤ ``len(costs)``."""
    if not 1 <= n <= len(costs):
        raise ValueError(f"partition: {n} groups of {len(costs)} items; pass 1 ≤ n ≤ {len(costs)}")
    groups: list[list[int]] = [[] for _ in range(n)]
    totals = [0] * n
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        g = min(range(n), key=lambda g: (totals[g], g))
        groups[g].append(i)
        totals[g] += costs[i]
    return groups


def children_ptxas() -> str | None:
    """The ``ptxas`` the children must compile with for their compile hashes to equal this process's: of
    ``TRITON_PTXAS_PATH`` and Triton's bundled ``ptxas``, the first whose ``--version`` is the version Triton
    holds for this process. None where Triton has no active CUDA backend, targets Blackwell (its own
    ``ptxas-blackwell``) or neither matches (the children then inherit the environment as it is)."""
    try:
        from triton.backends.nvidia import compiler as nvidia
        from triton.runtime.driver import driver

        target = driver.active.get_current_target()
        if target.backend != "cuda" or target.arch >= 100:
            return None
        version = nvidia.get_ptxas_version(target.arch)  # cached per process: what every compile hash here holds
    except Exception:  # noqa: BLE001 - no CUDA backend: nothing to align
        return None
    bundled = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")
    return matching_tool(version, [triton_ptxas_path(), bundled], _tool_version)


def matching_tool(version: str, candidates: list[str | None], read_version: Any) -> str | None:
    """The first existing path of ``candidates`` whose ``read_version(path)`` is ``version``, else None."""
    for path in candidates:
        if path and os.path.isfile(path) and read_version(path) == version:
            return path
    return None


def _tool_version(path: str) -> str | None:
    try:
        return subprocess.check_output([path, "--version"], timeout=30).decode("utf-8")
    except (OSError, subprocess.SubprocessError):
        return None


def _command() -> list[str]:
    """This interpreter, with ``-P`` when this process runs with it (a repository root on ``sys.path`` would put
    its top-level ``triton_kernels/`` before vLLM's)."""
    return [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m", "certvllm.attention.precompile"]


def precompile(spec: LayerSpec, class_costs: list[int], n: int, timeout: float = TIMEOUT_S) -> PrecompileReport:
    """Compile the shape classes (indices into ``warmup.shape_classes`` of ``spec``, costed by ``class_costs``) in
    ``n`` ≥ 2 children, into the disk cache of the calling environment. Never raises: failures are in the report's
    note (the serial warm-up compiles whatever is missing)."""
    start = time.perf_counter()
    ptxas = children_ptxas()
    env = child_environment({"TRITON_PTXAS_PATH": ptxas}) if ptxas else None
    with tempfile.TemporaryDirectory(prefix="certvllm-precompile-") as tmp:
        procs = []
        for k, group in enumerate(partition(class_costs, n)):
            files = [Path(tmp, f"{k}.{name}") for name in ("job", "out", "err")]
            files[0].write_text(json.dumps({"spec": asdict(spec), "classes": group}))
            with files[0].open() as job, files[1].open("w") as out, files[2].open("w") as err:
                procs.append((subprocess.Popen(_command(), stdin=job, stdout=out, stderr=err, env=env), files))
        compilations, failures, variants, backend = 0, [], set(), ""
        for k, (proc, (_, out, err)) in enumerate(procs):
            try:
                proc.wait(timeout=max(0.1, timeout - (time.perf_counter() - start)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                failures.append(f"process {k} killed after {timeout:g} s")
                continue
            lines = out.read_text().strip().splitlines()
            if proc.returncode != 0 or not lines:
                reason = (err.read_text().strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
                failures.append(f"process {k}: {reason}")
                continue
            result = json.loads(lines[-1])
            compilations += int(result["compilations"])
            variants.update(tuple(v) for v in result.get("variants", ()))
            backend = backend or result.get("backend", "")
    note = ""
    if failures:
        note = f"{len(failures)} of {n} failed, the serial pass compiles their classes: " + "; ".join(failures)
        logger.warning("certvllm warm-up: %s", note)
    return PrecompileReport(n, time.perf_counter() - start, compilations, note, frozenset(variants), backend)


def serial_misses(made: set[Variant], children: frozenset[Variant], backend: str = "", theirs: str = "") -> str:
    """Why the serial pass compiled variants itself: ``made`` are the variants it added, ``children`` the children's;
    empty when the children had compiled every one of them (same key, same hash: a disk-cache load). Otherwise a
    sentence for the log: how many missed and, for the first few, whether a child compiled the same specialisation
    under another hash (the kernel's source, Triton's environment or the target differ between the processes) or
    no child met that specialisation (then the nearest child key of the kernel and where the two first differ); and
    ``backend`` (this process's :func:`compiler_fingerprint`) against ``theirs`` (the children's) when they
    differ."""
    hashes = {h for _, _, h in children}
    missed = sorted(v for v in made if v[2] not in hashes)
    if not missed:
        return ""
    by_key = {(name, key): h for name, key, h in children}
    details = []
    for name, key, h in missed[:3]:
        if (name, key) in by_key:
            theirs_hash = by_key[name, key][:12]
            details.append(f"{name}: the same key under hash {h[:12]} here, {theirs_hash} in a child (the kernel's "
                           "source, Triton's environment or the target differ)")  # fmt: skip
            continue
        their_keys = [k for n, k, _ in children if n == name]
        if not their_keys:
            details.append(f"{name}: no child compiled this kernel")
            continue
        near = max(their_keys, key=lambda k: _common_prefix(k, key))
        at = _common_prefix(near, key)
        details.append(f"{name}: keys differ at character {at}: this process ...{key[max(0, at - 40):at + 40]}... a "
                       f"child ...{near[max(0, at - 40):at + 40]}...")  # fmt: skip
    if backend != theirs:
        details.append(f"Triton's compiler differs: {backend or 'none'} here, {theirs or 'none'} in the children")
    return f"{len(missed)} of {len(made)} variants were compiled again after the children: " + "; ".join(details)


def compiler_fingerprint() -> str:
    """What of Triton outside a kernel enters every compile hash in this process: its backend's hash (the ``ptxas``
    version, read once per process, and the target) and the tool paths set in the environment. Empty where no GPU
    backend is active (the interpreter)."""
    backend = jit_cache.backend_hash()
    return " ".join(w for w in (f"backend {backend}", triton_tool_paths()) if w) if backend else ""


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _run(job: dict[str, Any]) -> dict[str, Any]:
    """A child's work: the synthetic layer of ``job['spec']`` and the warm-up's calls of its classes."""
    from certvllm.attention.warmup import run_classes, shape_classes

    spec = LayerSpec(**job["spec"])
    config = CertConfig.model_validate(spec.config)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    classes = shape_classes(spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.max_model_len,
                            spec.max_num_seqs, config, block_size_tokens=spec.block_size_tokens)  # fmt: skip
    mine = [classes[i] for i in job["classes"]]
    report = run_classes(mine, spec.max_model_len, spec.describe(), lambda: spec.make_layer(config))
    return {"compilations": report.total_compilations, "seconds": report.total_seconds,
            "variants": sorted(jit_cache.variant_keys()), "backend": compiler_fingerprint()}  # fmt: skip


def main() -> None:
    """Entry point of a child: the job as JSON on stdin, the result as one JSON line on stdout."""
    result = _run(json.loads(sys.stdin.read()))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
