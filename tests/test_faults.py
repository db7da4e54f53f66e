"""Fault injection (issue 19 item 2), on the op and the worker runtime: corrupted device pages (key codes, key
offsets and scales, the scale exponent, value codes, scales and zero points, the η/ν annotations, the flags),
random bit flips anywhere in a page, page-ins that fail or return wrong pages, and host memory exhausted at
startup and while serving. The engine-level faults (a killed worker, faults inside a serving worker) are in
tests/vllm_plugin/test_serving_faults.py; the promotion-pool slot is a CUDA-only structure, its test runs in the GPU
lane.

What every test checks, against an independent float64 reference over the originals
(``certvllm.testing.exact_attention``, not the audit's own):

* **detected or harmless**: every head-step returned at rung 0-2 whose output is farther from exact attention
  than its certificate (E_key + E_val) is counted as an audit violation (audit at rate 1.0); rung-3/4 head-steps
  are exact (``audit.exact_tolerance``);
* **what the client gets** under the default ``audit_policy: fallback``: every returned head-step is within its
  certificate (violating rows recomputed exactly);
* **others unaffected**: a healthy row of the same batch gets bit-identical outputs and reports to the same call
  without the fault;
* **a failure is an error, not an output**: a page-in that fails raises a ``PageInError``; the worker runtime then
  recomputes the call exactly (CPU plugin), or the error propagates where it cannot.

Tolerances: the audit's own (``F64_SLACK`` and the 1 + 2⁻²⁰ bound-sum slack, ``audit.py``); the independent check
uses the certificate with no slack for "beyond" and 1 - 1e-6 of it for "a violation where the certificate held" (as
tests/attention/test_audit.py). Small shapes (D = 32, ≤ 211 tokens): the whole file runs in about a minute.
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from certvllm.attention.audit import Auditor, AuditOutcome, exact_tolerance
from certvllm.attention.op import certified_attention, dense_rows
from certvllm.config import load_config
from certvllm.kv.pagein import PageInEngine, PageInError
from certvllm.metrics import CertMetrics
from certvllm.testing import (
    PAGE_FIELDS,
    exact_attention,
    faulty_pagein,
    flip_page_bits,
    flip_random_bit,
    make_case,
    page_bytes_view,
    page_field,
    paged_batch,
)

HQ, HKV, D = 4, 2, 32
LENS = (200, 211, 96)  # rows 0 and 1 are corrupted, row 2 stays healthy
SCALE = 1 / math.sqrt(D)
BACKENDS = ["reference", "cpu"]


def _cases(seed: int, family: str = "sink_and_recency", lens=LENS, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    return [make_case(family, t, HQ, HKV, D, dtype, gen) for t in lens]


def _exact64(cs) -> torch.Tensor:
    return torch.stack([exact_attention(c.q, c.k, c.v, SCALE) for c in cs])


def _configs() -> dict:
    """``production``: the default preset (canary, rank and boundary tests, rung 2), audit at rate 1.0; ``loose``:
    reads most blocks with INT8 keys and INT4 values and never escalates on its own, so that nothing but the audit
    can notice a corruption (as tests/attention/test_audit.py)."""
    loose = load_config("paper", audit_rate=1.0, canary=False, rank_check=False, k_min=0, k_max=1, tau_cov=0.3,
                        rung1_tail_threshold=1.0, v_tol=10.0, exploration_rate=0.0)  # fmt: skip
    return {"production": load_config("default", audit_rate=1.0), "loose": loose}


class Audited:
    """One auditor (policy as given) with its outcomes and a private metrics registry."""

    def __init__(self, cfg, policy: str) -> None:
        self.cfg = cfg.model_copy(update={"audit_policy": policy})
        self.registry = CollectorRegistry()
        self.metrics = CertMetrics("test", "0", registry=self.registry)
        self.outcomes: list[AuditOutcome] = []
        self.auditor = Auditor(self.cfg, on_outcome=self._outcome, on_forced=self.metrics.count_audit_fallback)

    def _outcome(self, o: AuditOutcome) -> None:
        self.outcomes.append(o)
        self.metrics.record_audit(o.rung, o.ratio, o.violated)

    def call(self, cache, q, tables, lens, backend: str, pagein: PageInEngine | None = None, layer: int = 0):
        def run(force):
            return certified_attention(q, cache, tables, lens, self.cfg, SCALE, backend=backend, pagein=pagein,
                                       force_exact=force)  # fmt: skip

        return self.auditor.run(layer, q, cache, tables, lens, SCALE, run)

    def violations_metric(self) -> float:
        labels = {"model_name": "test", "engine": "0"}
        return sum(self.registry.get_sample_value("vllm:cert_audit_violations_total", {**labels, "rung": str(r)})
                   or 0.0 for r in range(5))  # fmt: skip


def _errors(res, ref64: torch.Tensor) -> torch.Tensor:
    """``[R, H_q]`` float64 ‖out − exact‖₂ by the independent reference."""
    return (res.out.double() - ref64).norm(dim=-1)


def _allowed_exact(cs, tokens: int) -> torch.Tensor:
    """``[R, H_q]`` the rung-3/4 allowance of every head (float32 exact path), from the originals."""
    rows = []
    for c in cs:
        g = HQ // HKV
        k = c.k.double().repeat_interleave(g, dim=1)  # [T, H_q, D]
        v_max = c.v.double().norm(dim=-1).amax()
        s_max = torch.einsum("hd,thd->th", c.q.double().abs(), k.abs()).amax(dim=0) * SCALE
        rows.append(exact_tolerance(v_max.expand(HQ), s_max, D, tokens, torch.float32))
    return torch.stack(rows)


def check_fault(cs, cache, tables, lens, cfg, backend: str, pagein_factory=None) -> dict:
    """Run the call under ``log`` (what the checks see) and under ``fallback`` (what the client gets) and assert
    the properties of the module docstring. Returns what caught the fault, for the caller's own assertions."""
    q = torch.stack([c.q for c in cs])
    ref = _exact64(cs)
    tokens = tables.shape[1] * 16
    make = pagein_factory or (lambda: None)

    seen = Audited(cfg, "log")
    res = seen.call(cache, q, tables, lens, backend, make())
    o = seen.outcomes[-1]
    assert o.rows.numel() == q.shape[0] * HQ  # rate 1.0: every head-step audited
    err = _errors(res, ref)
    rung = res.report.rung.long()
    bound = res.report.bound.double()
    violated = torch.zeros_like(rung, dtype=torch.bool)
    violated[o.rows, o.heads] = o.violated
    beyond = (rung <= 2) & ~(err <= bound)  # outside its certificate (NaN included)
    assert bool((violated | ~beyond).all()), f"outside the certificate and not counted: {err[beyond & ~violated]}"
    assert bool((~violated | ~(err <= bound * (1 - 1e-6)) | (rung >= 3)).all()), "a violation where the bound held"
    exact_rows = rung >= 3
    far = exact_rows & ~(err <= _allowed_exact(cs, tokens))
    assert bool((violated | ~far).all()), "an exact head-step far from exact attention and not counted"
    assert seen.violations_metric() == int(violated.sum()) == seen.auditor.violations

    served = Audited(cfg, "fallback")
    client = served.call(cache, q, tables, lens, backend, make())
    cerr = _errors(client, ref)
    crung = client.report.rung.long()
    ok = torch.where(crung <= 2, cerr <= client.report.bound.double(), cerr <= _allowed_exact(cs, tokens))
    assert bool(ok.all()), f"the client got an output outside its certificate: {cerr[~ok]}"
    return {
        "violations": int(violated.sum()),
        "beyond": int(beyond.sum()),
        "canary_rows": int(res.report.canary_fail[:, 0].sum()),
        "precondition_rows": int(res.report.precondition[:, 0].sum()),
        "rung4_rows": int((rung[:, 0] == 4).sum()),
        "res": res,
        "client": client,
        "violated_rows": sorted(set(o.rows[o.violated].tolist())),
    }


def _healthy_row_unchanged(fault: dict, clean_cache, tables, lens, cfg, backend, cs, row: int = 2) -> None:
    q = torch.stack([c.q for c in cs])
    clean = Audited(cfg, "log").call(clean_cache, q, tables, lens, backend)
    for res in (fault["res"], fault["client"]):
        assert torch.equal(res.out[row], clean.out[row])
        assert torch.equal(res.report.rung[row], clean.report.rung[row])
        assert torch.equal(res.report.bound[row], clean.report.bound[row])
    assert row not in fault["violated_rows"]


def _copy(cache):
    from certvllm.kv.cache import LayerKVCache

    return LayerKVCache(cache.pages.clone(), cache.shadow.clone(), cache.layout, cache.keys_channel_major)


# ---- corrupted device pages: each field, in both CPU implementations and both ladders ------------------------
FIELD_FAULTS = [
    # (field, XOR mask of each element, a word for the ids, what must catch it under the production ladder:
    #  "canary" (rows sent to rung 4, nothing left for the audit), "audit" (only the audit can see it), "none" (the
    #  outputs stay within their certificates); and whether the loose ladder must show outputs beyond their bounds)
    ("key_codes", 0x80, "msb", "canary", False),
    ("key_offsets", 1 << 12, "exp", "canary", True),  # fp16 exponent bit: ℓ × or ÷ 16
    ("key_scales", 0x10, "x1.4", "canary", False),  # σ × 2^{±1/2}
    ("exponent", 0x02, "x4", "canary", True),  # σ × 4 or ÷ 4 for every channel
    ("value_codes", 0x88, "msb", "audit", True),
    ("value_scales", 1 << 12, "exp", "audit", True),
    ("value_zeros", 1 << 14, "exp", "audit", True),
    ("eta", 1 << 31, "sign", "audit", False),  # η < 0: E_val goes down
    ("eta", 1 << 29, "shrink", "audit", False),  # η × 2^-64
    ("nu", 1 << 29, "shrink", "none", False),  # ν × 2^-64: V_max (and E_key) go down, not below the error here
    ("nu", 1 << 30, "grow", "none", False),  # ν × 2^64 (≈ 1e18): a vacuous but true certificate
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ladder", ["production", "loose"])
@pytest.mark.parametrize("field,mask,word,catcher,loose_beyond", FIELD_FAULTS,
                         ids=[f"{f[0]}-{f[2]}" for f in FIELD_FAULTS])  # fmt: skip
def test_a_corrupted_page_field_is_caught_or_harmless(field, mask, word, catcher, loose_beyond, ladder, backend):
    """Rows 0 and 1 corrupted (every full block of row 0 in KV head 0; four blocks of row 1 in both KV heads), row 2
    healthy. Besides the properties of ``check_fault``, the test must exercise what it names: the detector of the
    field under the production ladder, and, under the loose one, outputs actually pushed beyond their bounds."""
    cfg = _configs()[ladder]
    cs = _cases(7 + [f[:3] for f in FIELD_FAULTS].index((field, mask, word)))
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    clean = _copy(cache)
    full = (lens // 16).tolist()
    flip_page_bits(cache, tables[0, : full[0]], [0], field, mask)
    flip_page_bits(cache, tables[1, 2:6], [0, 1], field, mask)
    fault = check_fault(cs, cache, tables, lens, cfg, backend)
    _healthy_row_unchanged(fault, clean, tables, lens, cfg, backend, cs)
    if ladder == "production":
        if catcher == "canary":  # promoted blocks disagree with their shadow: both rows at rung 4, no violation left
            assert fault["canary_rows"] == 2 and fault["rung4_rows"] == 2 and fault["violations"] == 0, fault
        elif catcher == "audit":  # the canary compares scores only: the audit is what sees these
            assert fault["canary_rows"] == 0 and fault["violations"] > 0, fault
        else:
            assert fault["violations"] == 0 and fault["beyond"] == 0 and fault["rung4_rows"] == 0, fault
    elif loose_beyond:  # nothing but the audit can notice these here
        assert fault["beyond"] > 0 and fault["violations"] == fault["beyond"], fault


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask,what", [(0x01, "valid cleared"), (0x02, "precondition set")])
def test_corrupted_flags_send_the_rows_to_exact_attention(backend, mask, what):
    cfg = _configs()["production"]
    cs = _cases(3)
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    clean = _copy(cache)
    flip_page_bits(cache, tables[0, 3], [1], "flags", mask)  # one page of row 0
    flip_page_bits(cache, tables[1, 0], [0], "flags", mask)  # one page of row 1
    fault = check_fault(cs, cache, tables, lens, cfg, backend)
    report = fault["res"].report
    assert fault["precondition_rows"] == 2 and bool((report.rung[:2] == 4).all())  # caught by the flags
    assert fault["violations"] == 0  # the rows were recomputed from the originals: nothing to see
    _healthy_row_unchanged(fault, clean, tables, lens, cfg, backend, cs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reserved_header_bytes_change_nothing(backend):
    cfg = _configs()["production"]
    cs = _cases(4)
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    clean = _copy(cache)
    flip_page_bits(cache, tables[0, :12], [0, 1], "reserved", 0xFF)
    q = torch.stack([c.q for c in cs])
    a = Audited(cfg, "log").call(cache, q, tables, lens, backend)
    b = Audited(cfg, "log").call(clean, q, tables, lens, backend)
    assert torch.equal(a.out, b.out) and torch.equal(a.report.bound, b.report.bound)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ladder", ["production", "loose"])
def test_random_bit_flips_anywhere_in_a_page(backend, ladder):
    """40 trials of 1-16 random single-bit flips in random pages of rows 0 and 1 (any field, the padding excluded);
    every trial must satisfy the properties. Counts what caught what (printed with -s)."""
    cfg = _configs()[ladder]
    gen = torch.Generator().manual_seed(2024 + BACKENDS.index(backend))
    caught = {"trials": 0, "violations": 0, "beyond": 0, "canary_rows": 0, "precondition_rows": 0, "harmless": 0}
    for trial in range(40):
        cs = _cases(100 + trial, family=["sink_and_recency", "random", "retrieval_peaks"][trial % 3])
        cache, tables, lens = paged_batch(cs, cfg.value_group_size)
        clean = _copy(cache)
        flips = int(torch.randint(1, 17, (1,), generator=gen))
        for _ in range(flips):
            row = int(torch.randint(0, 2, (1,), generator=gen))
            col = int(torch.randint(0, int(lens[row]) // 16, (1,), generator=gen))
            flip_random_bit(cache, int(tables[row, col]), int(torch.randint(0, HKV, (1,), generator=gen)), gen)
        fault = check_fault(cs, cache, tables, lens, cfg, backend)
        if trial % 10 == 0:
            _healthy_row_unchanged(fault, clean, tables, lens, cfg, backend, cs)
        caught["trials"] += 1
        for key in ("violations", "beyond", "canary_rows", "precondition_rows"):
            caught[key] += fault[key]
        caught["harmless"] += int(fault["violations"] == 0 and fault["rung4_rows"] == 0)
    print(f"random bit flips, {ladder}, {backend}: {caught}")
    assert caught["trials"] == 40


def test_the_field_table_covers_every_used_byte_of_a_page():
    """The corruptible fields tile the page's used bytes exactly (so random flips can hit any of them)."""
    from certvllm.formats.layout import PageLayout

    lay = PageLayout(D)
    spans = sorted(page_field(lay, f)[:2] for f in PAGE_FIELDS)
    at = 0
    for start, nbytes in spans:
        assert start == at, (start, at)
        at += nbytes
    assert at == lay.used_bytes


def test_flips_are_silent_and_in_place():
    """The helpers change the page bytes in place and nothing else (no write generation, no shadow)."""
    cs = _cases(5)
    cache, tables, _ = paged_batch(cs)
    gens = cache.enable_generations().clone()
    shadow = cache.shadow.clone()
    before = page_bytes_view(cache, int(tables[0, 0]), 1).clone()
    flip_page_bits(cache, tables[0, 0], [1], "value_scales", 1 << 12)
    after = page_bytes_view(cache, int(tables[0, 0]), 1)
    start, nbytes, _ = page_field(cache.layout, "value_scales")
    changed = (before != after).nonzero().flatten()
    assert changed.numel() > 0 and int(changed.min()) >= start and int(changed.max()) < start + nbytes
    assert torch.equal(cache.generation, gens) and torch.equal(cache.shadow, shadow)


# ---- page-ins that fail -------------------------------------------------------------------------------------
# The compiled CPU kernel reads the shadow in place (no page-in copies); on the CPU the gathers are the torch
# reference's, the audit's and the op's own rung-3/4 recompute (the vLLM plugin passes vLLM's kernel instead).
@pytest.mark.parametrize("backend,where", [("reference", "call"), ("reference", "audit"), ("cpu", "audit")])
def test_a_failed_page_in_is_an_error_and_leaves_nothing_behind(backend, where):
    cfg = _configs()["production"]
    cs = _cases(11)
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    q = torch.stack([c.q for c in cs])
    run = Audited(cfg, "fallback")
    failing = faulty_pagein(mode="raise", times=1)
    if where == "audit":
        run.auditor._pageins[torch.device("cpu")] = failing
    with pytest.raises(PageInError, match="page-in from the host shadow tier failed: .*can't allocate memory"):
        run.call(cache, q, tables, lens, backend, failing if where == "call" else None)
    assert failing.faults == 1
    # the next call (the page-in works again) is as if the failed one never happened: same output as a fresh run
    again = run.call(cache, q, tables, lens, backend, failing if where == "call" else None)
    fresh = Audited(cfg, "fallback").call(cache, q, tables, lens, backend)
    assert torch.equal(again.out, fresh.out) and torch.equal(again.report.rung, fresh.report.rung)
    assert run.auditor.fallback_entries() == [] and run.auditor.violations == 0
    assert run.auditor.audited == q.shape[0] * HQ  # the failed call's audit was not counted


def test_a_page_in_returning_wrong_pages_is_caught():
    """Every gather of the call returns its pages with a flipped exponent bit (the audit reads the shadow through
    its own, healthy engine): promoted blocks break the canary (rung 4), whose exact recompute reads the same wrong
    pages; the audit catches every output that left its certificate or exactness, and the client gets outputs
    recomputed through the audit's engine."""
    cfg = _configs()["production"]
    cs = _cases(12)
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    fault = check_fault(cs, cache, tables, lens, cfg, "reference", lambda: faulty_pagein(mode="corrupt"))
    assert fault["violations"] > 0 and fault["canary_rows"] > 0, fault


# ---- the worker runtime: a failed page-in or exhausted host memory while serving ------------------------------
@pytest.fixture
def runtime(monkeypatch):
    """A ``WorkerRuntime`` (the CPU plugin's per-worker state) with a private metrics registry and one bound layer."""
    from certvllm.vllm_plugin import runtime as runtime_mod

    registry = CollectorRegistry()
    monkeypatch.setattr(runtime_mod, "CertMetrics",
                        lambda name, engine, **kw: CertMetrics(name, engine, registry=registry, **kw))  # fmt: skip
    cfg = load_config("default", audit_rate=1.0)
    rt = runtime_mod.WorkerRuntime(cfg, "test", "0")
    cs = _cases(21)
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    state = runtime_mod.LayerState("model.layers.5.self_attn.attn", 5, cache)
    q = torch.stack([c.q for c in cs])
    healthy = PageInEngine("cpu")

    def exact(rows: list[int]) -> torch.Tensor:  # what the CPU plugin passes: the engine's exact kernel
        return dense_rows(q, cache, tables, lens, SCALE, healthy, "auto")(rows)

    yield SimpleNamespace(rt=rt, state=state, q=q, tables=tables, lens=lens, cs=cs, exact=exact, registry=registry,
                          cfg=cfg)  # fmt: skip
    runtime_mod.WorkerRuntime._current = None


def _sample(registry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"model_name": "test", "engine": "0", **labels}) or 0.0


def _runtime_call(t, exact=True):
    return t.rt.certified(t.state, t.q, t.tables, t.lens, SCALE, None, t.exact if exact else None)


def _fail_audit_page_in(t, times: int | None = 1):
    """The worker's only page-ins on the CPU: the compiled kernel reads the shadow in place and rungs 3/4 run
    vLLM's kernel on it, so the gathers are the audit's (rate 1.0 here)."""
    failing = faulty_pagein(mode="raise", times=times)
    t.rt.audit._pageins[torch.device("cpu")] = failing
    return failing


def test_the_runtime_recomputes_a_call_exactly_when_its_page_in_fails(runtime, caplog):
    t = runtime
    failing = _fail_audit_page_in(t)
    with caplog.at_level(logging.ERROR, logger="vllm.certvllm"):
        res = _runtime_call(t)
    assert failing.faults == 1
    assert bool((res.report.rung == 4).all()) and float(res.report.bound.abs().max()) == 0.0
    ref = _exact64(t.cs)
    assert float((res.out.double() - ref).norm(dim=-1).max()) < 1e-5 * float(ref.abs().max())
    assert _sample(t.registry, "vllm:cert_layer_fallbacks_total", reason="page_in", layer="5") == len(t.cs)
    assert any("page-in from the host shadow tier failed" in r.getMessage() and "layer 5" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    # the next call is certified again, and audited
    again = _runtime_call(t)
    assert bool((again.report.rung <= 2).any())
    t.rt.metrics.flush()
    assert t.rt.audit.audited == len(t.cs) * HQ and t.rt.audit.violations == 0


def test_the_runtime_recomputes_a_call_exactly_when_host_memory_runs_out(runtime, monkeypatch):
    """An allocation of the certified path itself fails (the compiled kernel's outputs), not a page-in."""
    from certvllm.attention import cpu_fused

    t = runtime
    original = cpu_fused.certified_rows
    calls = {"n": 0}

    def exhausted(call):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes [injected]"
            )
        return original(call)

    monkeypatch.setattr(cpu_fused, "certified_rows", exhausted)
    res = _runtime_call(t)
    assert bool((res.report.rung == 4).all())
    assert _sample(t.registry, "vllm:cert_layer_fallbacks_total", reason="host_memory", layer="5") == len(t.cs)
    assert bool((_runtime_call(t).report.rung <= 2).any()) and calls["n"] == 2


def test_without_an_exact_kernel_of_its_own_the_error_propagates(runtime):
    """The CUDA path (no ``exact_rows``: its exact recompute would page in again) and an exact kernel that fails too
    end the call with the page-in error: an error, never an output."""
    t = runtime
    _fail_audit_page_in(t, times=None)
    with pytest.raises(PageInError):
        _runtime_call(t, exact=False)

    def broken(rows):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory [injected, exact kernel]")

    t.exact = broken
    with pytest.raises(PageInError):
        _runtime_call(t)
    assert _sample(t.registry, "vllm:cert_layer_fallbacks_total", reason="page_in", layer="5") == 0


def test_other_errors_are_not_swallowed(runtime, monkeypatch):
    """Only page-in failures and exhausted host memory fall back; a bug (any other exception) propagates."""
    from certvllm.attention import cpu_fused

    def bug(call):
        raise IndexError("index 99 is out of bounds [injected]")

    monkeypatch.setattr(cpu_fused, "certified_rows", bug)
    with pytest.raises(IndexError):
        _runtime_call(runtime)


# ---- host memory at startup -----------------------------------------------------------------------------------
def _vllm_config(max_model_len: int = 2048, host_memory_gb=None):
    model = SimpleNamespace(max_model_len=max_model_len, dtype=torch.bfloat16, get_num_layers=lambda p: 30,
                            get_num_kv_heads=lambda p: 3, get_head_size=lambda: 64)  # fmt: skip
    cert = {} if host_memory_gb is None else {"host_memory_gb": host_memory_gb}
    return SimpleNamespace(model_config=model, parallel_config=None, cache_config=SimpleNamespace(block_size=16),
                           additional_config={"certvllm": cert})  # fmt: skip


def test_exhausted_host_memory_at_startup_is_refused_naming_the_fix(monkeypatch):
    """No ``--cert-host-memory-gb``: the budget is half of the memory available when the engine plans its KV cache;
    with almost none left, the engine refuses to start with the minimum and the flag, instead of allocating."""
    import psutil

    from certvllm.vllm_plugin import host_tier, preflight

    monkeypatch.setattr(preflight, "cgroup_headroom", lambda: None)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=64 << 20))  # 64 MiB left
    with pytest.raises(preflight.StartupRefusal) as info:
        host_tier.cap_blocks(_vllm_config(), 10_000)
    msg = str(info.value)
    assert "--cert-host-memory-gb (unset: half of the host memory available at startup) can shadow only" in msg
    assert "fewer than the 129 blocks one 2048-token request needs" in msg and "Use --cert-host-memory-gb" in msg
    # the container's limit counts too: plenty on the machine, 64 MiB left under the cgroup
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=64 << 30))
    monkeypatch.setattr(preflight, "cgroup_headroom", lambda: 64 << 20)
    with pytest.raises(preflight.StartupRefusal):
        host_tier.cap_blocks(_vllm_config(), 10_000)
    monkeypatch.setattr(preflight, "cgroup_headroom", lambda: None)
    assert host_tier.cap_blocks(_vllm_config(), 10_000) == 10_000  # 32 GiB shadows them all


def test_certvllm_serve_refuses_exhausted_host_memory_before_vllm(monkeypatch, tmp_path, capsys):
    """The same rule before vLLM is imported (``preflight.host_tier_refusal`` without a budget): one line, exit 2."""
    import json

    import psutil

    from certvllm.cli import main
    from certvllm.vllm_plugin import preflight

    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
              "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}  # SmolLM2-135M's geometry  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(preflight, "cgroup_headroom", lambda: None)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=64 << 20))
    argv = ["serve", str(tmp_path), "--max-model-len", "8192", "--dtype", "bfloat16", "--port", "1"]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "host" in line]
    assert len(err) == 1 and err[0].startswith("certvllm: host memory is exhausted: without --cert-host-memory-gb")
    assert "0.03 GiB" in err[0] and "needs at least 0.18 GiB" in err[0] and "smaller --max-model-len" in err[0]
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=64 << 30))
    assert preflight.host_tier_refusal(argv[1:], None) is None  # 32 GiB: plenty


def test_a_shadow_that_cannot_be_allocated_fails_naming_the_layer_and_the_fix(monkeypatch):
    from certvllm.vllm_plugin import host_tier

    def no_memory(shape, dtype, pin):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes [injected]")

    monkeypatch.setattr(host_tier, "allocate_host", no_memory)
    kv = torch.zeros(8, 3, 128, 128, dtype=torch.uint8)
    with pytest.raises(MemoryError) as info:
        host_tier.layer_cache("model.layers.3.self_attn.attn", kv, 64, torch.bfloat16, 16)
    msg = str(info.value)
    assert "model.layers.3.self_attn.attn" in msg and "--cert-host-memory-gb" in msg and "can't allocate" in msg


# ---- a promotion-pool slot (CUDA only: the pool exists on the CUDA path alone) --------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the promotion pool is CUDA-only: runs in pytest -m gpu")
@pytest.mark.parametrize("canary", [True, False])
def test_a_corrupted_promotion_pool_slot_is_caught(canary):
    """A first call fills the layer's pool with the unquantized keys of its promoted pages; then every filled slot
    gets a flipped fp16/bf16 exponent bit, tags untouched, so the next call is served wrong "original" keys as pool
    hits. With the canary the promoted blocks' exact scores disagree with their INT8 scores (rung 4, recomputed on
    the device from the shadow); without it only the audit (rate 1.0) can see it, and it must count every output
    that left its certificate. Under ``audit_policy: fallback`` the violating rows are exact from the next call on
    (on CUDA the check lands after the call)."""
    from certvllm.kv.cache import LayerKVCache
    from certvllm.kv.cuda_pagein import CudaPageInEngine
    from certvllm.kv.residency import Residency
    from certvllm.testing import flip_pool_bits

    dev = torch.device("cuda")
    cfg = load_config("default", audit_rate=1.0, promotion_cache_fraction=1.0, canary=canary, rank_check=False,
                      cuda_graphs=False)  # fmt: skip
    cs = _cases(31, lens=(200, 211, 96))
    host, tables, lens = paged_batch(cs, cfg.value_group_size)
    cache = LayerKVCache(host.pages.to(dev), host.shadow, host.layout, host.keys_channel_major)
    q, tables_d, lens_d = torch.stack([c.q for c in cs]).to(dev), tables.to(dev), lens.to(dev)
    residency = Residency.for_layer(cache, cfg.promotion_cache_fraction)
    engine = CudaPageInEngine(dev)
    ref = _exact64(cs).to(dev)

    def call(auditor, cfg_used):
        def run(force):
            return certified_attention(q, cache, tables_d, lens_d, cfg_used, SCALE, backend="cuda", pagein=engine,
                                       residency=residency, force_exact=force)  # fmt: skip

        res = auditor.auditor.run(0, q, cache, tables_d, lens_d, SCALE, run)
        auditor.auditor.resolve(wait=True)
        return res

    warm = Audited(cfg, "log")
    call(warm, warm.cfg)
    filled = (residency.pool.tag >= 0).nonzero().flatten()
    assert filled.numel() > 0
    flip_pool_bits(residency.pool, filled, 1 << 14)
    seen = Audited(cfg, "fallback")
    res = call(seen, seen.cfg)
    assert residency.pool.take_stats()["hits"] > 0  # the wrong keys were served from the pool
    o = seen.outcomes[-1]
    err = (res.out.double() - ref).norm(dim=-1)
    rung = res.report.rung.long()
    violated = torch.zeros_like(rung, dtype=torch.bool)
    violated[o.rows, o.heads] = o.violated.to(dev)
    beyond = (rung <= 2) & ~(err <= res.report.bound.double())
    assert bool((violated | ~beyond).all()), "outside the certificate and not counted"
    if canary:
        assert bool(res.report.canary_fail[:, 0].any())
        exact = rung >= 3
        assert float(err[exact].max()) < 1e-3 * float(ref.abs().max())  # recomputed from the shadow, not the pool
    else:
        assert bool(beyond.any()), "the corruption moved no output beyond its bound (the test is vacuous)"
        again = call(seen, seen.cfg)  # the violating rows are exact now
        bad_rows = sorted(set(o.rows[o.violated].tolist()))
        assert bool((again.report.rung[bad_rows] == 4).all())
