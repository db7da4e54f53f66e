"""Test-only fault injection inside a serving vLLM worker (tests/vllm_plugin/test_serving_faults.py); nothing in
certvllm imports or reads any of this.

The server is started with ``--worker-extension-cls fault_worker.FaultInjector`` (vLLM's own option: the worker
imports this module and mixes the class into its worker class), with this folder on ``PYTHONPATH`` and
``CERTVLLM_TEST_FAULT_DIR`` naming a folder of the test's. Importing the module in the worker wraps
``WorkerRuntime.certified`` (one certified layer call): before each call it reads ``control.json`` from that folder
when the file changed, applies the fault it names and answers in ``state.json`` (atomically, both ways):

* ``{"seq": n, "kind": "corrupt", "field": F, "mask": M, "min_len": L, "layers": [..]}``: XOR ``M`` into field ``F``
  of every full block's page (all KV heads) of the rows at least ``L`` tokens long, in the listed layers (all
  when absent), once per block (``certvllm.testing.flip_page_bits``: in place, no write generation);
* ``{"kind": "page_in", "times": k}``: the audit's page-in engine fails its next ``k`` gathers as the CPU allocator
  fails when host memory is exhausted (``certvllm.testing.faulty_pagein``): on the CPU the audit's gathers are the
  worker's only page-ins (the compiled kernel and vLLM's exact kernel read the shadow in place);
* ``{"kind": "host_memory", "times": k}``: the compiled kernel's next ``k`` calls fail with the CPU allocator's
  out-of-memory error;
* ``{"kind": "none"}``: every fault off, the audit's page-in engine and rate back to the configured ones;
* any command may carry ``"audit_rate": r`` (the audit's sampler is replaced by one of rate ``r``).

``state.json`` holds ``seq`` (the last command applied), ``pid`` (this worker process), ``corrupted`` (pages
flipped), ``page_in_faults``, ``host_memory_faults``, ``audited``, ``violations``, ``entries`` (the context
lengths of the audit's active fallback entries, i.e. of the requests it sends to exact attention) and
``violation_lens`` (every context length at which an audited head-step was found in violation).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CONTROL_DIR = "CERTVLLM_TEST_FAULT_DIR"


class FaultInjector:
    """The worker extension: the import of this module is what installs the hook (see the module docstring)."""

    def certvllm_fault_pid(self) -> int:
        return os.getpid()


class _Faults:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.mtime = 0.0
        self.seq = -1
        self.command: dict[str, Any] = {"kind": "none"}
        self.corrupted: set[tuple[str, int]] = set()
        self.page_in = None  # the faulty engine while a page_in fault is on
        self.host_memory_left = 0
        self.host_memory_faults = 0
        self.violation_lens: set[int] = set()
        self.watched: Any = None  # the runtime whose audit outcomes are watched
        self.write_state(None)

    def write_state(self, runtime: Any) -> None:
        audit = getattr(runtime, "audit", None)
        state = {
            "seq": self.seq,
            "pid": os.getpid(),
            "corrupted": len(self.corrupted),
            "page_in_faults": 0 if self.page_in is None else self.page_in.faults,
            "host_memory_faults": self.host_memory_faults,
            "audited": 0 if audit is None else audit.audited,
            "violations": 0 if audit is None else audit.violations,
            "entries": [] if audit is None else sorted(e.min_len for e in audit.fallback_entries()),
            "violation_lens": sorted(self.violation_lens),
        }
        tmp = self.folder / "state.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.folder / "state.json")

    def watch(self, runtime: Any) -> None:
        """Record the context length of every audited head-step found in violation (which requests were hit)."""
        if self.watched is runtime:
            return
        self.watched = runtime
        record = runtime.audit.on_outcome

        def on_outcome(outcome: Any) -> None:
            self.violation_lens.update(int(n) for n in outcome.lens[outcome.violated].tolist())
            record(outcome)

        runtime.audit.on_outcome = on_outcome

    def poll(self, runtime: Any) -> None:
        self.watch(runtime)
        control = self.folder / "control.json"
        try:
            mtime = control.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime == self.mtime:
            return
        self.mtime = mtime
        command = json.loads(control.read_text())
        if command.get("seq", -1) == self.seq:
            return
        self.apply(runtime, command)
        self.seq = command["seq"]
        self.write_state(runtime)

    def apply(self, runtime: Any, command: dict[str, Any]) -> None:
        import torch

        from certvllm.attention.audit import AuditSampler
        from certvllm.kv.pagein import engine_for
        from certvllm.testing import faulty_pagein

        self.command = command
        cpu = torch.device("cpu")
        rate = command.get("audit_rate", runtime.config.audit_rate)
        runtime.audit.sampler = AuditSampler(rate, runtime.config.seed)
        kind = command["kind"]
        self.page_in, self.host_memory_faults = None, 0  # the counts of state.json are the current command's
        if kind == "page_in":
            self.page_in = faulty_pagein(mode="raise", times=int(command["times"]))
            runtime.audit._pageins[cpu] = self.page_in
        else:
            runtime.audit._pageins[cpu] = engine_for(cpu)
        self.host_memory_left = int(command.get("times", 0)) if kind == "host_memory" else 0

    def before_call(self, runtime: Any, state: Any, tables: Any, lens: Any) -> None:
        from certvllm.testing import flip_page_bits

        self.poll(runtime)
        command = self.command
        if command["kind"] != "corrupt":
            return
        layers = command.get("layers")
        if layers is not None and state.index not in layers:
            return
        long_rows = (lens.cpu() >= int(command["min_len"])).nonzero().flatten().tolist()
        for row in long_rows:
            full = int(lens[row]) // state.cache.layout.block_size
            for block in tables[row, :full].tolist():
                if (state.name, int(block)) in self.corrupted:
                    continue
                heads = list(range(state.cache.num_kv_heads))
                flip_page_bits(state.cache, [int(block)], heads, command["field"], int(command["mask"]))
                self.corrupted.add((state.name, int(block)))
        if long_rows:
            self.write_state(runtime)


def _install() -> None:
    folder = os.environ.get(CONTROL_DIR)
    if not folder:
        return
    from certvllm.attention import cpu_fused
    from certvllm.vllm_plugin import runtime as runtime_mod

    faults = _Faults(Path(folder))
    certified = runtime_mod.WorkerRuntime.certified
    compiled = cpu_fused.certified_rows

    def certified_with_faults(self, state, q, tables, lens, scale, generator, *args, **kwargs):  # noqa: ANN001
        faults.before_call(self, state, tables, lens)
        try:  # every further argument (exact_rows, the per-request slots …) as the runtime's own method takes it
            return certified(self, state, q, tables, lens, scale, generator, *args, **kwargs)
        finally:
            if faults.command["kind"] in ("page_in", "host_memory", "corrupt"):
                faults.write_state(self)

    def compiled_with_faults(call):  # noqa: ANN001
        if faults.host_memory_left > 0:
            faults.host_memory_left -= 1
            faults.host_memory_faults += 1
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
                "to allocate 1048576 bytes. Error code 12 (Cannot allocate memory) [injected]"
            )
        return compiled(call)

    runtime_mod.WorkerRuntime.certified = certified_with_faults
    cpu_fused.certified_rows = compiled_with_faults


_install()
