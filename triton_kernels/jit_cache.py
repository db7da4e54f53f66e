"""How many variants of certvllm's Triton and Gluon kernels this process holds: the count of compilations.

Each ``triton.jit`` / ``gluon.jit`` kernel keeps, per device, a dict from compile key to compiled kernel
(``JITFunction.device_caches[device][0]`` in Triton 3.6 to 3.9); an entry is added exactly when a launch
meets a key it has not seen (compiled, or loaded from Triton's on-disk cache). Summing those dicts over the
kernels below counts the variants made so far; the difference between two counts is the number of
compilations in between. Reading them launches nothing and changes nothing (the dicts are only iterated:
``device_caches`` is a defaultdict, and indexing it would create an entry). Triton's global
``knobs.runtime.jit_post_compile_hook`` is left alone, since another library may have set it.

Under the interpreter kernels are not compiled: every count is 0.
"""

from __future__ import annotations

import importlib

LAUNCHED: dict[str, tuple[str, ...]] = {
    "phase1_mma": ("_phase1_mma_kernel",),
    "phase1_mma_gluon": ("_phase1_mma_gluon_kernel",),
    "phase2": ("_promote_kernel", "_attend_kernel"),
    "phase2_glue": ("_global_max_kernel", "_rerun_inputs_kernel"),
    "call_inputs": ("_call_inputs_kernel",),
    "prepare": ("_prepare_kernel",),
    "select": ("_select_kernel",),
    "finalize": ("_finalize_kernel", "_combine_exact_kernel"),
    "fused": ("_fused_kernel",),
    "fused_gluon": ("_fused_gluon_kernel",),
    "pool": (
        "_claim1",
        "_claim2",
        "_claim3",
        "_settle",
        "_direct_lookup",
        "_fill_list",
        "_resident_mark",
        "_resident_free_slots",
        "_resident_assign",
        "_resident_fill",
    ),
    "prefetch": ("_stage_pages_kernel", "_snapshot_tags_kernel", "_serve_record_kernel"),
    "encode": ("_encode_pages_kernel",),
    "gather": ("_gather_pages_kernel", "_fill_pool_kernel"),
    "shadow_write": ("_scatter_kernel",),
    "audit_check": ("_audit_partial_kernel", "_audit_verdict_kernel"),
    "report_tally": ("_tally_kernel",),
}
"""Every kernel the launchers launch, by module of this package."""
GLUON_MODULES = ("phase1_mma_gluon", "fused_gluon")
"""Modules that import only where Triton has Gluon."""


def kernels() -> dict[str, object]:
    """``module.kernel`` name → the kernel object, for every importable module of :data:`LAUNCHED`."""
    found: dict[str, object] = {}
    for module, names in LAUNCHED.items():
        try:
            mod = importlib.import_module(f"{__package__}.{module}")
        except ImportError:
            if module in GLUON_MODULES:  # a Triton without Gluon: those kernels never launch
                continue
            raise
        for name in names:
            found[f"{module}.{name}"] = getattr(mod, name)
    return found


def variants(kernel: object) -> int:
    """Compiled variants of one kernel, over all devices (0 for an interpreted kernel)."""
    caches = getattr(kernel, "device_caches", None)
    if not isinstance(caches, dict):
        return 0
    return sum(len(entry[0]) for entry in list(caches.values()))


def variants_by_kernel() -> dict[str, int]:
    """``module.kernel`` → its compiled variants (kernels with none included)."""
    return {name: variants(k) for name, k in kernels().items()}


def compilations() -> int:
    """Compiled variants of all of certvllm's kernels in this process (compare two reads)."""
    return sum(variants_by_kernel().values())


Variant = tuple[str, str, str]
"""``(module.kernel, in-memory compile key, compile hash)`` of one compiled variant: the key is Triton's
specialisation and options as a string, the hash names the variant's entry in Triton's disk cache."""


def backend_hash() -> str:
    """The hash of Triton's compiler backend for the current device, which enters every compile hash: for CUDA the
    ``ptxas`` version (read once per process) and the target. Empty where no GPU backend is active (the
    interpreter)."""
    try:
        from triton.compiler.compiler import make_backend
        from triton.runtime.driver import driver

        return str(make_backend(driver.active.get_current_target()).hash())
    except Exception:  # noqa: BLE001 - no active GPU driver: nothing is compiled, nothing to compare
        return ""


def variant_keys() -> set[Variant]:
    """Every compiled variant of certvllm's kernels in this process (empty under the interpreter). Two processes
    that compiled the same variant list the same key and hash; the same key with another hash means the kernel's
    source, Triton's cache-relevant environment or the target differ between them (:func:`backend_hash`)."""
    found: set[Variant] = set()
    for name, kernel in kernels().items():
        caches = getattr(kernel, "device_caches", None)
        if not isinstance(caches, dict):
            continue
        for entry in list(caches.values()):
            for key, compiled in list(entry[0].items()):
                found.add((name, str(key), str(getattr(compiled, "hash", ""))))
    return found
