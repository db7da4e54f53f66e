"""``CertConfig``: the one validated object holding every tolerance and switch.

Tolerances (``key_tol``, ``v_tol``, ``bound_tol``) are **relative to V_max**, the largest value
norm in the head's context: the attention output is a convex combination of values, so
‖O‖ ≤ V_max and a tolerance of 0.05 means "5 % of the largest possible output norm". The
reported bounds (``e_key``, ``e_val``) are absolute.

Presets live as YAML in ``configs/`` (shipped as ``certvllm.configs``) and load by name.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from certvllm.bounds.policy import FORCED_RUNGS, LadderPolicy

DEFAULT_PRESET = "default"


class CertConfigError(ValueError):
    """A certvllm configuration value is invalid; the message names the field and the fix."""


class CertConfig(BaseModel):
    """Tolerances and switches of certified attention (see ``docs/certification.md``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    mode: Literal["certified", "naive", "dense"] = Field(
        "certified",
        description="certified: the full ladder; naive: INT8 keys and INT4 values everywhere, no "
        "promotion, checks or fallback (a baseline; bounds are still reported); dense: exact attention.",
    )
    value_group_size: Literal[8, 16, 32] = Field(16, description="INT4 value group size g.")
    key_code_levels: int = Field(
        255, ge=1, le=255,
        description="Largest INT8 key code the encoder uses (255). Fewer levels in the same page (15: 4-bit keys) are "
        "a stress format for the evaluation's stress study: coarser keys whose certificate still holds. Never lower "
        "it in production.",
    )  # fmt: skip
    value_code_levels: int = Field(
        15, ge=1, le=15,
        description="Largest INT4 value code the encoder uses (15). Fewer (3: 2-bit values) is a stress format for "
        "the evaluation's stress study (see key_code_levels). Never lower it in production.",
    )  # fmt: skip
    key_selection: Literal["coverage", "budget"] = Field(
        "coverage",
        description="Which blocks are read with unquantized keys: 'coverage' (the paper: the top blocks covering "
        "tau_cov of the estimated mass) or 'budget' (the fewest top blocks, at least k_min, whose estimated E_key "
        "fits key_tol; every query head of a KV head then reads the union of its group's blocks). 'budget' needs a "
        "finite key_tol.",
    )
    tau_cov: float = Field(0.995, gt=0.0, le=1.0, description="Mass coverage target of the FP16-key set.")
    k_min: int = Field(2, ge=0, description="Fewest key blocks promoted per query head.")
    k_max: int = Field(128, ge=0, description="Most key blocks promoted per query head before rung 1.")
    rung1_multiplier: float = Field(2.0, ge=1.0, description="Rung 1 widens K_max by this factor.")
    rung1_tail_threshold: float = Field(
        0.02, ge=0.0, le=1.0, description="Rung 1 fires when the estimated tail mass exceeds this."
    )
    key_tol: float = Field(
        math.inf, gt=0.0, description="Rung 1 also fires while the estimated E_key exceeds key_tol·V_max."
    )
    v_tol: float = Field(0.05, ge=0.0, description="Rung 2 promotes FP16 values until E_val ≤ v_tol·V_max.")
    value_k_max: int | None = Field(None, ge=0, description="Most value blocks promoted per head (None: no cap).")
    rank_check: bool = Field(True, description="Top-r rank-consistency and boundary tests (rung 3).")
    rank_depth: int = Field(1, ge=1, le=64, description="r: how many top blocks must keep their order.")
    eps_guard: float = Field(0.01, ge=0.0, description="Log-mass tie tolerance of the rank test.")
    canary: bool = Field(True, description="Score-consistency canary on promoted blocks (rung 4).")
    bound_tol: float = Field(
        math.inf, gt=0.0, description="Rung 3 for any head whose E_key + E_val exceeds bound_tol·V_max."
    )
    exploration_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="Probability of promoting an extra key block (canary coverage)."
    )
    prefill: Literal["exact", "certified"] = Field(
        "exact",
        description="Queries of a prefill that read cached blocks: exact dense over the originals, or certified.",
    )
    host_memory_gb: float | None = Field(
        None,
        gt=0.0,
        description="Host (tier-2) memory budget for shadow pages in GiB; None: half of the host "
        "memory available at startup (within the container's cgroup limit).",
    )
    promotion_cache_fraction: float = Field(
        0.0625,
        ge=0.0,
        le=1.0,
        description="CUDA path only: device-resident promotion cache. Per layer, a VRAM pool of unquantized "
        "key pages (one 16-token block of one KV head each) with this fraction of the layer's (block, KV head) "
        "pages as slots, reused across decode steps so that blocks promoted again are not paged in over PCIe "
        "again. Costs fraction × (2·D + 1) bytes per token per KV head of device memory (0.0625: 16 B at "
        "D = 128, i.e. 272 of FP16's 512). 0 disables it. Two candidate slots per page; a slot is served only "
        "when its (block, KV head) and the block's write generation both match, so it never serves a "
        "rewritten block (docs/certification.md §5.1). With decode_pass resident the pool is the resident pass's "
        "(kv.promotion_cache.ResidentPool): slots allocated explicitly through a per-page slot table (4 B per page) "
        "and holding value pages too, fraction × (4·D + 1) bytes per token per KV head. The CPU path ignores it.",
    )
    prefetch_fraction: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="CUDA path with the promotion cache only: step prefetch (certvllm.kv.prefetch). The engine "
        "stages, on a side stream while the previous layers run, the key pages each layer read over PCIe at "
        "the previous step, into a ring of 2 slots shared by all layers, each holding this fraction of one "
        "layer's (block, KV head) pages. Costs 2 × fraction × one layer's key half in the shadow dtype for the "
        "whole model (0.25 with 32 layers: 0.008 of the FP16 cache). 0 disables it. Served only under the "
        "block's current write generation, as the promotion cache.",
    )
    decode_pass: Literal["two_pass", "resident"] = Field(
        "two_pass",
        description="CUDA path only: how a decode call is computed. two_pass: phase 1 scores every block, selection "
        "picks the promoted blocks, phase 2 pages their keys in and attends (the paper's order). resident: one pass "
        "with the promoted set F taken from the keys the promotion pool already holds, and a top-up (selection, "
        "page-in and the pass again) only for the KV-head groups it leaves outside key_tol, v_tol or the rung-3 "
        "checks (certvllm.attention.resident). Both certify the same bound for whatever they promoted. The CPU "
        "path ignores it.",
    )
    cuda_graphs: bool = Field(
        True,
        description="CUDA path only: each layer's decode call replays a CUDA graph captured per (row bucket, "
        "width bucket) (certvllm.attention.graphs): one launch per layer call instead of about 70 and the Python "
        "between them; each layer's write of a decode step replays one per token bucket (certvllm.kv.write_graphs) "
        "instead of two launches from Python. The step prefetch (prefetch_fraction) issues other layers' work "
        "from inside a call, which a per-layer graph cannot hold, so it is off while this is on. The CPU path "
        "ignores it.",
    )
    warmup_workers: int | None = Field(
        None,
        ge=0,
        description="CUDA path only: child processes that compile the startup warm-up's shape classes in parallel "
        "into the Triton disk cache before the serial warm-up loads them (certvllm.attention.precompile). None: one "
        "per two CPUs, at most 8, fewer when free device memory is short (2 GiB each); 0 or 1: the serial warm-up "
        "alone. A child that fails costs only its time: the serial pass compiles what it did not.",
    )
    kernel_tuning: str = Field(
        "",
        description="CUDA path only: kernel launch parameters that differ from the defaults, as comma-separated "
        "FIELD=VALUE pairs of certvllm.triton_kernels.tuning.KernelTuning (e.g. 'select_first_window=64,"
        "promote_warps=4'; docs/troubleshooting.md lists the fields and their defaults). They change how fast the "
        "certified quantities are computed, never what is certified. Empty: the defaults.",
    )
    shadow_writes: Literal["sm_stores", "copy_engine"] = Field(
        "sm_stores",
        description="CUDA path only: how a prefill's originals reach the host tier. sm_stores: every token's rows "
        "are stored over PCIe from the SMs, on the layer's stream. copy_engine: the engine blocks a prefill fills "
        "completely are staged on the device and copied by DMA on a side stream (certvllm.kv.shadow_copy), the "
        "other tokens stored from the SMs; the block ids come from vLLM's GPU model runner (V1's host copy of the "
        "block table, or a host mirror of V2's writes to it), and the SM stores stay where neither is found. The same "
        "shadow bytes either way. The CPU path ignores it.",
    )
    dense_backend: Literal["auto", "sdpa", "xformers"] = Field(
        "auto",
        description="Kernel of the exact dense recompute on the reference and CPU paths (rungs 3/4, dense mode): "
        "sdpa (torch SDPA), xformers (CUDA, when installed), or auto (SDPA, or xformers on CUDA where it is "
        "installed and measured faster and in agreement; certvllm.attention.dense_backend).",
    )
    seed: int = Field(0, ge=0, description="Seed of the exploration draws (and, on a separate stream, of the audit's).")
    audit_rate: float = Field(
        0.001,
        ge=0.0,
        le=1.0,
        description="Audit mode (certvllm.attention.audit, docs/reliability.md): the probability with which each "
        "certified head-step is re-checked against exact attention over the shadow originals (float64), drawn by "
        "batch row (a drawn row is checked at every query head): within "
        "E_key + E_val for rungs 0-2, equal to exact within float rounding for rungs 3/4. 0 turns audits off; "
        "1 audits every head-step. Draws come from their own stream seeded by seed (exploration draws are "
        "unaffected).",
    )
    audit_policy: Literal["log", "fallback", "abort"] = Field(
        "fallback",
        description="What an audit violation does besides being counted and logged: log (nothing more), fallback "
        "(the layer runs exact for the rest of that request; on the CPU the violating row is recomputed exactly "
        "in the same step), abort (every layer of that request runs exact from then on and the request is "
        "reported for abortion; vLLM 0.32 gives a worker no per-request abort, see docs/reliability.md).",
    )
    force_fallback: Literal["none", "head", "layer"] = Field(
        "none",
        description="Testing and audits: escalate every head to rung 3 (head) or every row to rung 4 (layer) after "
        "the certified computation, so the exact path can be checked against the dense backend.",
    )

    @field_validator("kernel_tuning")
    @classmethod
    def _check_kernel_tuning(cls, value: str) -> str:
        if value.strip():  # the kernel package is imported only where a tuning is asked for
            from certvllm.triton_kernels.tuning import parse_tuning

            parse_tuning(value)  # a ValueError names the entry and the fix
        return value

    @model_validator(mode="after")
    def _check_relations(self) -> CertConfig:
        if self.k_min > self.k_max:
            raise ValueError(f"k_min={self.k_min} must be ≤ k_max={self.k_max}; raise k_max or lower k_min")
        if self.key_selection == "budget" and not math.isfinite(self.key_tol):
            raise ValueError(f"key_selection=budget selects by key_tol, which is {self.key_tol}; set a finite "
                             "key_tol (the default preset's is 0.02) or use key_selection=coverage")  # fmt: skip
        return self

    @property
    def code_levels(self) -> tuple[int, int]:
        """``(key_code_levels, value_code_levels)``: the page format's largest codes (``PageLayout``)."""
        return self.key_code_levels, self.value_code_levels

    @property
    def step_prefetch_fraction(self) -> float:
        """``prefetch_fraction`` as the CUDA path runs it: 0 while ``cuda_graphs`` is on (the field's description)."""
        return 0.0 if self.cuda_graphs else self.prefetch_fraction

    @property
    def ladder(self) -> LadderPolicy:
        """The decision parameters of a layer call, as the kernels take them."""
        return LadderPolicy(
            certified=self.mode == "certified", key_selection=self.key_selection, tau_cov=self.tau_cov,
            k_min=self.k_min, k_max=self.k_max,
            k_max_widened=math.ceil(self.rung1_multiplier * self.k_max),
            rung1_tail_threshold=self.rung1_tail_threshold, key_tol=self.key_tol, v_tol=self.v_tol,
            bound_tol=self.bound_tol, value_k_max=-1 if self.value_k_max is None else self.value_k_max,
            rank_check=self.rank_check, rank_depth=self.rank_depth, eps_guard=self.eps_guard, canary=self.canary,
            forced_rung=FORCED_RUNGS[self.force_fallback], exploration_rate=self.exploration_rate,
        )  # fmt: skip


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid certvllm config ({source}):"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<config>"
        allowed = e.get("ctx") or {}
        detail = e["msg"]
        if allowed:
            detail += " (" + ", ".join(f"{k}={v}" for k, v in allowed.items() if k != "error") + ")"
        given = e.get("input")
        lines.append(
            f"  - {field}: {detail}; got {given!r}. Fix it in the preset file or with --cert-{field.replace('_', '-')}."
        )
    return "\n".join(lines)


REMOVED_FIELDS = {
    "overlap_shadow_writes": "was removed on 2026-12-07: measured in serving, storing the originals from a side "
    "stream slowed every prefill (docs/performance.md, eleventh session); delete it from the config",
}
"""Config fields that no longer exist, and what to do instead."""


def make_config(source: str = "<arguments>", **values: Any) -> CertConfig:
    """Build a config, turning validation errors into a :class:`CertConfigError`."""
    removed = [f"{name} {REMOVED_FIELDS[name]}" for name in values if name in REMOVED_FIELDS]
    if removed:
        raise CertConfigError(f"invalid certvllm config ({source}): " + "; ".join(removed))
    try:
        return CertConfig(**values)
    except ValidationError as err:
        raise CertConfigError(_format_errors(err, source)) from None


RENAMED_PRESETS = {
    "budget": "became the default preset on 2026-12-02 (selection by the key-error budget): use --cert-config default "
    "or leave --cert-config out",
}
"""Preset names that no longer exist, and what to use instead."""


def parse_key_values(pairs: list[str], what: str) -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` (a command line's overrides) as a dict, each value read as a YAML scalar
    (``0.12`` a float, ``true`` a bool, ``null`` None, anything else a string). ``what`` names the flag in the
    error. Raises ``ValueError`` for an entry without ``=`` or without a key."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{what} takes KEY=VALUE (e.g. gpu_memory_utilization=0.2), got {pair!r}")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return out


def preset_names() -> list[str]:
    """Names of the presets shipped in ``certvllm.configs``."""
    root = resources.files("certvllm.configs")
    names = (p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))
    return sorted(n for n in names if n != "example")  # example.yaml documents the format


def _read_yaml(text: str, source: str) -> dict[str, Any]:
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise CertConfigError(f"{source}: expected a mapping of config fields, got {type(data).__name__}")
    return data


def load_config(preset_or_path: str | Path | None = None, **overrides: Any) -> CertConfig:
    """Load a preset by name (``paper``, ``default``, ``strict``, ``fast``) or a YAML file, then
    apply ``overrides`` (field=value). ``None`` loads the default preset."""
    name = str(preset_or_path) if preset_or_path is not None else DEFAULT_PRESET
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise CertConfigError(
                f"config file {name!r} does not exist; pass a preset name {preset_names()} or a YAML path"
            )
        data = _read_yaml(path.read_text(), name)
        source = str(path)
    else:
        entry = resources.files("certvllm.configs") / f"{name}.yaml"
        if not entry.is_file() and name in RENAMED_PRESETS:
            raise CertConfigError(f"certvllm preset {name!r} {RENAMED_PRESETS[name]}; presets: {preset_names()}")
        if not entry.is_file():
            raise CertConfigError(
                f"unknown certvllm preset {name!r}; choose one of {preset_names()} or pass a YAML file path"
            )
        data = _read_yaml(entry.read_text(), f"preset {name}")
        source = f"preset {name}"
    data.update({k: v for k, v in overrides.items() if v is not None})
    return make_config(source, **data)
