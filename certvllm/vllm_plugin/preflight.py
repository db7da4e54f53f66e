"""What ``certvllm serve`` can decide from its command line and the model folder alone, before vLLM is imported.

* The host tier's minimum (:func:`host_tier_refusal`): the budget (``--cert-host-memory-gb``, or without it half of
  the host memory available now) must hold the shadow of one full-length request, from the model's
  ``config.json`` and the ``--max-model-len`` / ``--block-size`` / ``--dtype`` / ``--tensor-parallel-size``
  flags. The arithmetic is the one ``host_tier`` applies inside vLLM (:func:`shadow_bytes_per_token`,
  :func:`min_request_blocks`), and where a flag or the folder leaves a value open the check takes the least
  memory vLLM could end up needing, so it never refuses what vLLM's own check (``host_tier.check_minimum``)
  would accept; what it cannot read (a hub model not in the local cache, pipeline parallelism) is left to that
  check, which ``certvllm serve`` also reports as one line (:class:`StartupRefusal`).
* The CPU's activation dtype (:func:`cpu_activation_dtype`): a bf16/fp16 model runs in float32 on a processor
  without native instructions for its dtype (AVX2/FMA only: PyTorch then emulates bf16, about 5-10x slower).

Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import itertools
import json
import math
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from certvllm.vllm_plugin.layer_kinds import certified_layer_count

GIB = 1 << 30
DEFAULT_BLOCK = 16  # the smallest block size certified runs with (pages hold 16-token blocks)
HALF_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16", "fp16": "float16"}
FLOAT32_NAMES = ("float32", "float", "fp32")
# the x86 / Arm flags (/proc/cpuinfo) with which PyTorch runs each half dtype natively
NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16", "bf16"), "float16": ("avx512_fp16", "amx_fp16", "asimdhp")}


class StartupRefusal(ValueError):
    """A setting certvllm refuses at startup; the message names the value, the allowed range and the fix.

    ``certvllm serve`` prints it as one ``certvllm:`` line and exits with code 2, also when vLLM raised it from
    inside its own config check (wrapped in a pydantic ``ValidationError``: :func:`find_refusal`)."""


def find_refusal(err: BaseException) -> StartupRefusal | None:
    """The :class:`StartupRefusal` behind ``err``: itself, its cause/context chain, or a pydantic error's ``ctx``."""
    seen: set[int] = set()
    stack: list[BaseException] = [err]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, StartupRefusal):
            return current
        errors = getattr(current, "errors", None)
        if callable(errors) and type(current).__name__ == "ValidationError":
            try:
                details = errors()
            except Exception:  # noqa: BLE001 - any other ``errors`` attribute: not pydantic's
                details = []
            for detail in details:
                inner = (detail.get("ctx") or {}).get("error") if isinstance(detail, dict) else None
                if isinstance(inner, BaseException):
                    stack.append(inner)
        stack += [e for e in (current.__cause__, current.__context__) if e is not None]
    return None


def shadow_bytes_per_token(layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Host bytes of one token's shadow (keys and values of every layer and KV head of this rank)."""
    return layers * kv_heads * 2 * head_dim * itemsize


def min_request_blocks(max_model_len: int, block_size: int) -> int:
    """vLLM blocks one request of ``max_model_len`` tokens needs (one more for the block being written)."""
    return math.ceil(max_model_len / block_size) + 1


def gib_at_least(nbytes: int) -> float:
    """``nbytes`` in GiB rounded *up* to 0.01, so that the printed minimum is itself enough."""
    return math.ceil(nbytes / GIB * 100) / 100


# -- reading the command line and the model folder -------------------------------------------------------------
def option(args: list[str], *names: str) -> str | None:
    """The value of the last ``NAME VALUE`` / ``NAME=VALUE`` among ``names`` in ``args`` (None if absent)."""
    value = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def option_values(args: list[str], name: str) -> list[str]:
    """The values of the last ``NAME V1 V2 ...`` (up to the next ``-`` flag) / ``NAME=V1,V2`` in ``args``, as
    vLLM's list options take them (``--kv-cache-dtype-skip-layers sliding_window 0 5``); [] if absent."""
    values: list[str] = []
    for i, arg in enumerate(args):
        if arg == name:
            values = list(itertools.takewhile(lambda a: not a.startswith("-"), args[i + 1 :]))
        elif arg.startswith(name + "="):
            values = [v for v in arg.split("=", 1)[1].split(",") if v]
    return values


def model_argument(args: list[str]) -> str | None:
    """The model of ``vllm serve`` arguments: the first positional argument or ``--model``."""
    if args and not args[0].startswith("-"):
        return args[0]
    return option(args, "--model")


def _human_int(text: str) -> int | None:
    """vLLM's ``--max-model-len`` syntax: ``8192``, ``8k`` (10³), ``8K`` (2¹⁰); None for anything else."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if not match:
        return None
    number, unit = float(match.group(1)), match.group(2)
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}.get(unit) or 2 ** (10 * "KMGT".index(unit) + 10)
    return int(number * scale)


def read_model_config(model: str, args: list[str]) -> dict[str, Any] | None:
    """The model's ``config.json`` (a local folder, or the hub's local cache), its text part for multimodal
    configs; None when it cannot be read without the network."""
    path = Path(model) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        cached = try_to_load_from_cache(model, "config.json", revision=option(args, "--revision"))
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def config_dtype(config: dict[str, Any]) -> str | None:
    """The dtype the model folder declares (``dtype`` or the older ``torch_dtype``), normalised."""
    raw = config.get("dtype") or config.get("torch_dtype")
    if not isinstance(raw, str):
        return None
    raw = raw.removeprefix("torch.").lower()
    return HALF_DTYPES.get(raw, "float32" if raw in FLOAT32_NAMES else raw)


@dataclass(frozen=True)
class ShadowGeometry:
    """What the host shadow of one rank holds per token, and the request length it must hold once; ``ranks``
    tensor-parallel ranks share the node's budget (each shadows its own KV heads of the same blocks)."""

    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int
    max_model_len: int
    block_size: int
    ranks: int = 1
    hybrid: bool = False

    @property
    def per_token(self) -> int:
        return shadow_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.itemsize)

    @property
    def blocks(self) -> int:
        """Blocks of one full-length request; a hybrid model's (``layers`` = its certified layers only) without the
        block being written, a lower bound on what vLLM's KV cache groups will need (``host_tier.min_blocks``)."""
        if self.hybrid:
            return math.ceil(self.max_model_len / self.block_size)
        return min_request_blocks(self.max_model_len, self.block_size)

    @property
    def min_bytes(self) -> int:
        """Host bytes of one full-length request on this node (all ranks)."""
        return self.blocks * self.block_size * self.per_token * self.ranks


def shadow_geometry(args: list[str], config: dict[str, Any]) -> ShadowGeometry | None:
    """The geometry vLLM will give the shadow, from the ``vllm serve`` arguments and the model's config; None
    where a value cannot be pinned down here (left to the check inside vLLM). Open values take their smallest
    outcome: max length = the smallest length key of the config (vLLM takes the smallest too, then may scale it
    up for RoPE scaling), block size 16, 2-byte activations unless ``--dtype float32``."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    pp = _human_int(option(args, "--pipeline-parallel-size", "-pp") or "1")
    tp = _human_int(option(args, "--tensor-parallel-size", "-tp") or "1")
    if pp != 1 or not tp:
        return None  # pipeline stages split the layers in vLLM's own way: left to its check
    text = option(args, "--max-model-len")
    if text is None:
        keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_seq_length", "seq_len", "model_max_length")  # fmt: skip
        lengths = [int(config[k]) for k in keys if isinstance(config.get(k), int) and config[k] > 0]
        max_len = min(lengths) if lengths else None
    else:
        max_len = _human_int(text)
    block = _human_int(option(args, "--block-size") or str(DEFAULT_BLOCK))
    if not max_len or max_len <= 0 or not block:
        return None
    itemsize = 4 if (option(args, "--dtype") or "auto").lower() in FLOAT32_NAMES else 2
    certified = layers
    if "--disable-sliding-window" in args:  # every layer certified, the length capped at the window
        window = config.get("sliding_window")
        max_len = min(max_len, window) if isinstance(window, int) and window > 0 else max_len
    else:  # a hybrid model's sliding-window layers keep native pages (hybrid.prepare): no shadow
        certified = certified_layer_count(config, layers, option_values(args, "--kv-cache-dtype-skip-layers"))
        if not certified:
            return None  # open, or nothing certified: vLLM's own check refuses it with the fix (hybrid.prepare)
    return ShadowGeometry(certified, max(1, kv_heads // tp), head_dim, itemsize, max_len, block, tp,
                          hybrid=certified < layers)  # fmt: skip


DEFAULT_AVAILABLE_FRACTION = 0.5
"""Without ``--cert-host-memory-gb`` the host tier's budget is this fraction of the host memory available."""


def cgroup_headroom() -> int | None:
    """Bytes left under this container's cgroup-v2 memory limit, if one is set."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(int(limit) - used, 0)


def default_budget_bytes() -> int:
    """The host tier's budget without ``--cert-host-memory-gb``: half of the memory available now, the smaller of
    the machine's and the container's headroom (read again by the engine when it plans its KV cache)."""
    import psutil

    available = psutil.virtual_memory().available
    headroom = cgroup_headroom()
    if headroom is not None:
        available = min(available, headroom)
    return int(DEFAULT_AVAILABLE_FRACTION * available)


def host_tier_refusal(args: list[str], host_memory_gb: float | None) -> StartupRefusal | None:
    """The refusal of a host-tier budget that cannot shadow one full-length request of this model (None: it can, or
    the model's geometry cannot be read here and vLLM's own check decides): an explicit ``--cert-host-memory-gb``,
    or without one half of the host memory available now (host memory exhausted at startup)."""
    model = model_argument(args)
    config = read_model_config(model, args) if model else None
    geometry = shadow_geometry(args, config) if config else None
    if geometry is None:
        return None
    budget = int(host_memory_gb * GIB) if host_memory_gb is not None else default_budget_bytes()
    if budget >= geometry.min_bytes:
        return None
    g = geometry
    ranks = f", x {g.ranks} tensor-parallel ranks sharing the node's budget" if g.ranks > 1 else ""
    if host_memory_gb is None:
        return StartupRefusal(
            f"host memory is exhausted: without --cert-host-memory-gb the host tier gets half of the memory available "
            f"now, {budget / GIB:.2f} GiB, which cannot hold the host shadow of one {g.max_model_len}-token request of "
            f"{model}: that needs at least {gib_at_least(g.min_bytes):.2f} GiB ({g.blocks} blocks of {g.block_size} "
            f"tokens x {g.per_token / 1024:.1f} KiB per token{ranks}). Free host memory, or use a smaller "
            "--max-model-len."
        )
    return StartupRefusal(
        f"--cert-host-memory-gb {host_memory_gb:g} cannot hold the host shadow of one {g.max_model_len}-token "
        f"request of {model}: that needs at least {gib_at_least(g.min_bytes):.2f} GiB ({g.blocks} blocks of "
        f"{g.block_size} tokens x {g.per_token / 1024:.1f} KiB per token = {g.layers} {'certified ' * g.hybrid}"
        f"layers x {g.kv_heads} KV heads x 2 x {g.head_dim} x {g.itemsize} bytes{ranks}). Use --cert-host-memory-gb "
        f"{gib_at_least(g.min_bytes):.2f} or "
        "more, or a smaller --max-model-len."
    )


# -- the CPU's activation dtype ---------------------------------------------------------------------------------
def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The processor's feature flags (``flags`` on x86, ``Features`` on Arm) from ``/proc/cpuinfo``."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def runs_natively(dtype: str, flags: set[str]) -> bool:
    """Whether the processor has instructions for ``dtype`` arithmetic (float32 always)."""
    if dtype not in NATIVE_FLAGS:
        return True
    return any(flag in flags for flag in NATIVE_FLAGS[dtype])


def cpu_activation_dtype(args: list[str], model_dtype: str | None, flags: set[str]) -> tuple[str | None, str]:
    """``(dtype to pass as --dtype or None to leave vLLM's choice, the reason for the log)`` on the CPU.

    An explicit ``--dtype`` is kept. A bf16/fp16 model on a processor without native instructions for that
    dtype runs in float32 (vLLM would otherwise keep the model's dtype and PyTorch emulate it)."""
    given = option(args, "--dtype")
    if given is not None and given.lower() != "auto":
        return None, f"--dtype {given} as given"
    effective = model_dtype if model_dtype in NATIVE_FLAGS else None
    if effective is None:
        return None, f"the model's dtype ({model_dtype or 'unknown'}) as vLLM resolves it"
    if runs_natively(effective, flags):
        native = " or ".join(NATIVE_FLAGS[effective])
        return None, f"{effective}: this {platform.machine()} CPU runs it natively ({native})"
    return "float32", (
        f"float32 activations: the model is {effective} but this {platform.machine()} CPU has no native {effective} "
        f"instructions (none of {', '.join(NATIVE_FLAGS[effective])} in /proc/cpuinfo), so PyTorch would emulate "
        f"it several times slower; pass --dtype {effective} to keep it"
    )
