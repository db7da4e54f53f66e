"""Audit mode (``certvllm.attention.audit``): real calls of the op, checked against the float64 exact reference
(``certvllm.testing.exact_attention`` over the originals, computed here independently of the audit).

Tolerances, all stated:

* rungs 0–2: a head-step is a violation exactly when ‖O − O_exact‖₂ > (E_key + E_val)·(1 + 2⁻²⁰) + 2⁻³⁰·V_max
  (``F64_SLACK``), i.e. the certificate itself with float64 evaluation slack; the tests compare the audit's
  verdicts with the independent float64 error (its own error agrees with ours to 1e-9 relative);
* rungs 3/4: ``exact_tolerance`` (float32 rounding of the exact path, ×2 for an unknown reduction order);
* the sampling rate: the audited count of n head-steps lies within 5 standard deviations of n·rate
  (binomial, √(n·rate·(1 − rate))); the draws are seeded, so each run is deterministic.

Small shapes (D = 32, a few hundred tokens): every test runs in well under a few seconds on 2 cores, but the one
Triton-interpreter test (marked slow).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from prometheus_client import CollectorRegistry

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (the interpreter test)

from certvllm.attention.audit import (  # noqa: E402
    ALL_LAYERS,
    Auditor,
    AuditOutcome,
    AuditSampler,
    _Pending,
    exact_tolerance,
    reference_heads,
)
from certvllm.attention.op import certified_attention  # noqa: E402
from certvllm.bounds.report import CertifiedOutput  # noqa: E402
from certvllm.config import CertConfigError, load_config, make_config  # noqa: E402
from certvllm.kernels import cpu as cpu_kernels  # noqa: E402
from certvllm.kv.cache import LayerKVCache  # noqa: E402
from certvllm.kv.deferred import DeferredRead  # noqa: E402
from certvllm.kv.pagein import PageInEngine  # noqa: E402
from certvllm.metrics import CertMetrics  # noqa: E402
from certvllm.testing import FAMILIES, exact_attention, make_case, paged_batch  # noqa: E402

HQ, HKV, D = 4, 2, 32
LENS = (37, 160, 211)


def cases(family: str, seed: int, lens=LENS, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    return [make_case(family, t, HQ, HKV, D, dtype, gen) for t in lens]


def exact64(cs, scale: float) -> torch.Tensor:
    """``[R, H_q, D]`` float64: exact attention of every row over its originals."""
    return torch.stack([exact_attention(c.q, c.k, c.v, scale) for c in cs])


class Recorder:
    """An auditor with its outcomes collected and fed to a fresh ``CertMetrics``."""

    def __init__(self, cfg, defer: bool | None = None) -> None:
        self.registry = CollectorRegistry()
        self.metrics = CertMetrics("test", "0", registry=self.registry)
        self.outcomes: list[AuditOutcome] = []
        self.forced: list[tuple[int, int]] = []
        self.auditor = Auditor(cfg, on_outcome=self._outcome, on_forced=self._forced, defer=defer)
        self.metrics.add_drain(lambda: self.auditor.resolve(wait=True))

    def _outcome(self, o: AuditOutcome) -> None:
        self.outcomes.append(o)
        self.metrics.record_audit(o.rung, o.ratio, o.violated)

    def _forced(self, layer: int, rows: int) -> None:
        self.forced.append((layer, rows))
        self.metrics.count_audit_fallback(layer, rows)

    def call(self, cfg, cache, q, tables, lens, scale, layer=0, backend="auto", generator=None):
        def run(force):
            return certified_attention(q, cache, tables, lens, cfg, scale, backend=backend, generator=generator,
                                       force_exact=force)  # fmt: skip

        return self.auditor.run(layer, q, cache, tables, lens, scale, run)

    def sample(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, {"model_name": "test", "engine": "0", **labels})
        return 0.0 if value is None else value

    def audits(self) -> float:
        return sum(self.sample("vllm:cert_audits_total", rung=str(r)) for r in range(5))

    def violations(self) -> float:
        return sum(self.sample("vllm:cert_audit_violations_total", rung=str(r)) for r in range(5))

    def last(self) -> AuditOutcome:
        return self.outcomes[-1]


def check_against_exact(outcome: AuditOutcome, res, ref64: torch.Tensor) -> torch.Tensor:
    """The audit's error for each audited head-step equals the independent float64 one (1e-9 relative, 1e-12
    of the output scale absolute); returns the independent error ``[n]`` (on the host, as the outcome's tensors:
    on a GPU the op's output and the reference are read back first)."""
    rows, heads = outcome.rows, outcome.heads
    out, ref64 = res.out.cpu(), ref64.cpu()
    ours = (out[rows, heads].double() - ref64[rows, heads]).norm(dim=-1)
    scale = ref64.abs().max()
    assert torch.allclose(outcome.error, ours, rtol=1e-9, atol=1e-12 * float(scale)), (outcome.error, ours)
    return ours


# ---- (a) healthy caches: no violation, every head-step counted ------------------------------------------------
CONFIGS = {
    "default": {},
    "paper": {"preset": "paper"},
    "strict": {"preset": "strict"},
    "naive": {"preset": "naive"},
    "rung3": {"force_fallback": "head"},
    "rung4": {"force_fallback": "layer"},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_healthy_cache_has_no_violation_and_every_head_step_is_counted(family, kind):
    overrides = dict(CONFIGS[kind])
    cfg = load_config(overrides.pop("preset", "default"), audit_rate=1.0, **overrides)
    cs = cases(family, 10 * FAMILIES.index(family) + list(CONFIGS).index(kind))
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    q = torch.stack([c.q for c in cs])
    scale = 1 / math.sqrt(D)
    rec = Recorder(cfg)
    res = rec.call(cfg, cache, q, tables, lens, scale)
    o = rec.last()
    assert len(rec.outcomes) == 1 and o.rows.numel() == len(cs) * HQ  # rate 1.0: every head-step
    ref = exact64(cs, scale)
    err = check_against_exact(o, res, ref)
    bound = res.report.bound[o.rows, o.heads].double()
    certified = o.rung <= 2
    assert bool((err[certified] <= bound[certified] * (1 + 2**-20) + 1e-30).all())  # the certificate holds
    assert not bool(o.violated.any()), (o.error[o.violated], o.allowed[o.violated], o.rung[o.violated])
    assert bool((o.ratio <= 1).all())
    assert rec.audits() == len(cs) * HQ == rec.auditor.audited
    assert rec.violations() == 0 == rec.auditor.violations
    count = rec.registry.get_sample_value("vllm:cert_audit_error_ratio_count", {"model_name": "test", "engine": "0"})
    assert count == len(cs) * HQ
    for r in range(5):
        assert rec.sample("vllm:cert_audits_total", rung=str(r)) == int((o.rung == r).sum())
    if kind in ("rung3", "rung4"):
        assert bool((o.rung >= 3).all())


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_reference_and_compiled_paths_agree_on_the_audit(backend):
    """The audit runs the same way over the torch reference and the compiled CPU kernel (``auto`` where built)."""
    cfg = load_config("default", audit_rate=1.0)
    cs = cases("retrieval_peaks", 7, lens=(300, 64), dtype=torch.bfloat16)
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    q = torch.stack([c.q for c in cs])
    rec = Recorder(cfg)
    res = rec.call(cfg, cache, q, tables, lens, 0.2, backend=backend)
    check_against_exact(rec.last(), res, exact64(cs, 0.2))
    assert rec.auditor.violations == 0 and rec.auditor.audited == 2 * HQ


def test_exact_tolerance_is_float_rounding_sized():
    """Rungs 3/4's allowance: a few float32 ulps of V_max for float32 exact paths, the model dtype's for a
    model-dtype kernel (the CPU plugin's vLLM kernel)."""
    v, s = torch.tensor([2.0], dtype=torch.float64), torch.tensor([10.0], dtype=torch.float64)
    f32 = float(exact_tolerance(v, s, 128, 4096, torch.float32)[0])
    bf16 = float(exact_tolerance(v, s, 128, 4096, torch.bfloat16)[0])
    u = 2.0**-24
    gam = lambda n: n * u / (1 - n * u)  # noqa: E731
    expected = 2.0 * (2 * gam(136) * 10 + 4 * u * 10 + 16 * u + 2 * gam(4098)) * (1 + 2**-10)
    assert f32 / 2.0 == pytest.approx(expected, rel=1e-9) and f32 / 2.0 < 2e-3  # 1.3e-3 of V_max, γ_T dominates
    assert bf16 / 2.0 == pytest.approx(f32 / 2.0 + 2**-8 * 23 * (1 + 2**-10), rel=1e-6)


# ---- (b) corrupted device pages -------------------------------------------------------------------------------
def _loose(canary: bool):
    """A config that reads most blocks with INT8 keys / INT4 values and never escalates on its own."""
    return load_config("paper", audit_rate=1.0, audit_policy="log", canary=canary, rank_check=False, k_min=0,
                       k_max=1, tau_cov=0.3, rung1_tail_threshold=1.0, v_tol=10.0, exploration_rate=0.0)  # fmt: skip


def corrupt(cache, block_ids, head: int, what: str) -> None:
    """Flip bits in pages of ``block_ids`` × ``head`` after encoding: the INT8 key codes (bit 7), the key scale
    codes (bit 4: σ × 2^{±1/2}), or the value scales (fp16 exponent bit 12: ×/÷ 16)."""
    lay = cache.layout
    n, d, g = lay.block_size, lay.head_dim, lay.groups
    for b in block_ids.tolist():
        page = cache.pages[b, head]
        if what == "key_codes":
            page[lay.k_codes : lay.k_codes + n * d] ^= 0x80
        elif what == "key_scales":
            page[lay.k_scale_code : lay.k_scale_code + d] ^= 0x10
        elif what == "value_scales":
            scales = page[lay.v_scale : lay.v_scale + 2 * n * g].view(torch.int16)
            scales ^= 1 << 12
        else:
            raise ValueError(what)


@pytest.mark.parametrize("what", ["key_codes", "key_scales", "value_scales"])
@pytest.mark.parametrize("canary", [False, True])
def test_corrupted_pages_are_caught_whenever_the_output_leaves_its_bound(what, canary):
    cfg = _loose(canary)
    cs = cases("sink_and_recency", 11, lens=(200, 211, 96))
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    full = lens // 16
    corrupt(cache, tables[0, : int(full[0])], 0, what)  # every full block of row 0, KV head 0
    corrupt(cache, tables[1, 1:4], 1, what)  # three blocks of row 1, KV head 1
    q = torch.stack([c.q for c in cs])
    scale = 1 / math.sqrt(D)
    rec = Recorder(cfg)
    res = rec.call(cfg, cache, q, tables, lens, scale)
    o = rec.last()
    assert o.rows.numel() == len(cs) * HQ
    err = check_against_exact(o, res, exact64(cs, scale))
    bound = res.report.bound[o.rows, o.heads].double()
    beyond = (o.rung <= 2) & (err > bound)  # outputs outside their certificate, by the independent reference
    assert bool((o.violated | ~beyond).all()), "an output outside its certificate was not caught"
    assert bool((~o.violated | (err > bound * (1 - 1e-6))).all()), "a violation where the certificate held"
    assert rec.violations() == int(o.violated.sum()) == rec.auditor.violations
    if not canary:  # nothing else can notice the corruption: it must move outputs beyond their bounds
        assert bool(beyond.any()), f"{what}: the corruption moved no output beyond its bound (test is vacuous)"
        assert bool(o.violated[o.rows == 2].logical_not().all())  # row 2 is healthy
    elif what == "value_scales":  # the canary compares scores: it cannot see values, the audit must
        assert bool(beyond.any()) and bool(o.violated.any())


# ---- (c) the sampling rate --------------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [0.001, 0.01, 0.3])
def test_fraction_audited_matches_the_rate(rate):
    sampler = AuditSampler(rate, seed=3)
    gen = torch.Generator().manual_seed(5)
    sizes = torch.randint(1, 600, (4000,), generator=gen).tolist()
    n = sum(sizes)
    picked = sum(len(sampler.sample(s)) for s in sizes)
    sd = math.sqrt(n * rate * (1 - rate))
    assert abs(picked - n * rate) <= 5 * sd, (picked, n * rate, sd)


def test_the_fraction_of_corrupted_outputs_caught_matches_the_rate():
    """Row 0's values corrupted (every call leaves the same k of its head-steps outside their certificate, found at
    rate 1), then 150 calls at rate 0.1 under ``log``: the violations counted are k per draw of row 0 and no
    other, and row 0 is drawn 150 × 0.1 = 15 times within 5 sd of Binomial(150, 0.1), so the share of corrupted
    outputs caught matches the rate (the draw is by row: the k of one call are caught together)."""
    cfg, cs, cache, tables, lens, q = _violating_setup("log")
    scale = 1 / math.sqrt(D)
    rec = Recorder(cfg.model_copy(update={"audit_rate": 1.0}))
    rec.call(cfg, cache, q, tables, lens, scale)
    o = rec.last()
    k = int(o.violated.sum())
    assert k > 0 and set(o.rows[o.violated].tolist()) == {0}
    rate, calls = 0.1, 150
    rec = Recorder(cfg.model_copy(update={"audit_rate": rate}))
    for _ in range(calls):
        rec.call(cfg, cache, q, tables, lens, scale)
    caught = [int(x.violated.sum()) for x in rec.outcomes if bool((x.rows == 0).any())]
    assert all(c == k for c in caught)  # the same corrupted head-steps each time row 0 is drawn
    assert rec.violations() == k * len(caught)
    assert all(not bool(x.violated[x.rows != 0].any()) for x in rec.outcomes)  # the healthy row passes
    sd = math.sqrt(calls * rate * (1 - rate))
    assert abs(len(caught) - calls * rate) <= 5 * sd, (len(caught), calls * rate, sd)


def test_sampling_is_seeded_and_independent_of_call_sizes():
    def picks(seed, sizes):
        s = AuditSampler(0.05, seed)
        out, base = [], 0
        for n in sizes:
            out += [base + i for i in s.sample(n)]
            base += n
        return out

    a = picks(1, [1000])
    assert a == picks(1, [300, 1, 699]) == picks(1, [1] * 1000)  # the same head-steps whatever the batching
    assert a != picks(2, [1000])
    assert AuditSampler(0.0, 0).sample(10**9) == [] and AuditSampler(1.0, 0).sample(5) == [0, 1, 2, 3, 4]


def test_fractional_rate_end_to_end_and_the_exploration_stream_is_untouched():
    """At rate 0.25 the audited share of 40 calls × 3 rows × 4 heads lies within 5 sd of 0.25 (the draws are by
    row: a drawn row is audited at every query head, so the count is H_q × Binomial(120 rows, 0.25)), the counters
    equal the audited count, and the op's exploration generator draws exactly as without audits."""
    cfg = load_config("default", audit_rate=0.25, exploration_rate=0.3)
    off = load_config("default", audit_rate=0.0, exploration_rate=0.3)
    cs = cases("random", 21, lens=(100, 64, 130))
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    q = torch.stack([c.q for c in cs])
    rec, plain = Recorder(cfg), Recorder(off)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for _ in range(40):
        a = rec.call(cfg, cache, q, tables, lens, 0.17, generator=g1)
        b = plain.call(off, cache, q, tables, lens, 0.17, generator=g2)
        assert torch.equal(a.out, b.out) and torch.equal(a.report.k_star, b.report.k_star)
    assert torch.equal(g1.get_state(), g2.get_state())
    for o in rec.outcomes:  # whole rows: every query head of each drawn row
        pairs = sorted(zip(o.rows.tolist(), o.heads.tolist(), strict=True))
        assert pairs == [(r, h) for r in sorted(set(o.rows.tolist())) for h in range(HQ)]
    rows = 40 * 3
    assert rec.auditor.audited % HQ == 0
    sd = math.sqrt(rows * 0.25 * 0.75)
    assert abs(rec.auditor.audited // HQ - rows * 0.25) <= 5 * sd
    assert rec.audits() == rec.auditor.audited and rec.violations() == 0
    assert plain.auditor.audited == 0 and plain.outcomes == []


# ---- (d) policies ---------------------------------------------------------------------------------------------
def _violating_setup(policy: str):
    cfg = _loose(False).model_copy(update={"audit_policy": policy})
    cs = cases("sink_and_recency", 11, lens=(200, 211))
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    corrupt(cache, tables[0, :12], 0, "value_scales")  # row 0 only
    q = torch.stack([c.q for c in cs])
    return cfg, cs, cache, tables, lens, q


@pytest.mark.parametrize("policy", ["log", "fallback", "abort"])
def test_policies(policy):
    cfg, cs, cache, tables, lens, q = _violating_setup(policy)
    scale = 1 / math.sqrt(D)
    ref = exact64(cs, scale)
    rec = Recorder(cfg)
    first = rec.call(cfg, cache, q, tables, lens, scale, layer=3)
    o = rec.last()
    assert bool(o.violated.any()) and set(o.rows[o.violated].tolist()) == {0}
    if policy == "log":
        assert bool((first.report.rung[0] <= 2).all())  # returned as computed
        assert rec.auditor.fallback_entries() == []
    else:  # the violating row of this very call is recomputed exactly (CPU)
        assert bool((first.report.rung[0] == 4).all()) and float(first.report.bound[0].max()) == 0.0
        assert float((first.out[0].double() - ref[0]).norm(dim=-1).max()) < 1e-5 * float(ref.abs().max())
        entries = rec.auditor.fallback_entries()
        assert len(entries) == 1 and entries[0].layer == (3 if policy == "fallback" else ALL_LAYERS)
        assert entries[0].column == (int(lens[0]) - 1) // 16 and entries[0].block == int(tables[0, entries[0].column])
    assert bool((first.report.rung[1] <= 2).all())  # the healthy row keeps its certificate

    # the next step of the same request in the same layer (its row one token longer is the same request)
    again = rec.call(cfg, cache, q, tables, lens, scale, layer=3)
    other_layer = rec.call(cfg, cache, q, tables, lens, scale, layer=4)
    if policy == "log":
        assert bool((again.report.rung[0] <= 2).all()) and rec.forced == []
    else:
        assert bool((again.report.rung[0] == 4).all()) and bool((again.report.rung[1] <= 2).all())
        layer4_forced = policy == "abort"  # a fallback entry is the layer's; an abort entry every layer's
        assert ((4, 1) in rec.forced) == layer4_forced and (3, 1) in rec.forced
        assert bool((other_layer.report.rung[0] == 4).all())  # forced, or its own audit's violation fixed
        fallbacks = rec.sample("vllm:cert_layer_fallbacks_total", reason="audit", layer="3")
        assert fallbacks == 1
        assert not bool(rec.outcomes[-2].violated[rec.outcomes[-2].rung == 4].any())  # exact rows pass the audit
    aborts = rec.auditor.take_aborts()
    assert len(aborts) == (1 if policy == "abort" else 0) and rec.auditor.take_aborts() == []

    # a call without that request (it ended): its entry is dropped, the next call of the row is certified again
    rec.call(cfg, cache, q[1:], tables[1:], lens[1:], scale, layer=3)
    rec.call(cfg, cache, q[1:], tables[1:], lens[1:], scale, layer=4)
    assert rec.auditor.fallback_entries() == []


def test_a_new_request_on_a_reused_block_is_not_forced():
    """An entry matches only rows at least as long as the request was: a shorter row reusing the block is
    another request."""
    cfg, cs, cache, tables, lens, q = _violating_setup("fallback")
    rec = Recorder(cfg)
    rec.call(cfg, cache, q, tables, lens, 0.2, layer=0)
    assert len(rec.auditor.fallback_entries()) == 1
    assert rec.auditor.forced_rows(0, tables, lens).tolist() == [True, False]
    assert rec.auditor.forced_rows(0, tables, lens + 5).tolist() == [True, False]  # the same request, later
    shorter = lens.clone()
    shorter[0] = int(lens[0]) - 1  # same block at the same column, fewer tokens: a different request
    assert rec.auditor.forced_rows(0, tables, shorter).tolist() == [False, False]
    assert rec.auditor.forced_rows(1, tables, lens) is None  # another layer: no entry


def test_deferred_checks_act_on_later_calls_as_on_cuda():
    """``defer=True`` (what CUDA pages do): nothing is read inside the call; the metrics' flush resolves the
    check (counted, entry made) and the next call of the request's layer runs it exactly."""
    cfg, cs, cache, tables, lens, q = _violating_setup("fallback")
    rec = Recorder(cfg, defer=True)
    first = rec.call(cfg, cache, q, tables, lens, 0.2, layer=0)
    assert bool((first.report.rung[0] <= 2).all()) and rec.outcomes == [] and rec.audits() == 0
    rec.metrics.flush()  # the flusher's drain: waits for the queued checks
    assert rec.audits() == 2 * HQ and rec.violations() > 0 and len(rec.auditor.fallback_entries()) == 1
    again = rec.call(cfg, cache, q, tables, lens, 0.2, layer=0)
    assert bool((again.report.rung[0] == 4).all()) and bool((again.report.rung[1] <= 2).all())


# ---- (e) configuration --------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,needle", [(1.5, "less than or equal to 1"), (-0.1, "greater than or equal to 0")])
def test_audit_rate_is_validated(value, needle):
    with pytest.raises(CertConfigError) as info:
        make_config(audit_rate=value)
    msg = str(info.value)
    assert "audit_rate" in msg and needle in msg and repr(value) in msg and "--cert-audit-rate" in msg


def test_audit_policy_is_validated_and_defaults():
    with pytest.raises(CertConfigError) as info:
        make_config(audit_policy="panic")
    msg = str(info.value)
    assert "audit_policy" in msg and "'log', 'fallback' or 'abort'" in msg and "'panic'" in msg
    assert "--cert-audit-policy" in msg
    cfg = load_config()
    assert cfg.audit_rate == 0.001 and cfg.audit_policy == "fallback"
    assert load_config("default", audit_rate=0).audit_rate == 0.0
    with pytest.raises(ValueError, match=r"audit_rate=2 is outside \[0, 1\]"):
        AuditSampler(2, 0)


def test_rate_zero_does_no_work():
    cfg = load_config("default", audit_rate=0.0)
    cs = cases("random", 1, lens=(50,))
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    rec = Recorder(cfg)
    rec.call(cfg, cache, torch.stack([c.q for c in cs]), tables, lens, 0.2)
    assert rec.outcomes == [] and not rec.auditor.enabled and rec.audits() == 0


def test_set_rate_changes_the_draws_and_keeps_the_seed():
    """``Auditor.set_rate`` (benchmarks compare rates inside one engine): a fresh sampler on the config's seed; the
    counts so far are kept."""
    cfg = load_config("default", audit_rate=1.0, seed=3)
    cs = cases("random", 2, lens=(50, 70))
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    q = torch.stack([c.q for c in cs])
    rec = Recorder(cfg)
    rec.call(cfg, cache, q, tables, lens, 0.2)
    assert rec.auditor.audited == 2 * HQ
    rec.auditor.set_rate(0.0)
    rec.call(cfg, cache, q, tables, lens, 0.2)
    assert rec.auditor.audited == 2 * HQ and not rec.auditor.enabled
    rec.auditor.set_rate(0.3)
    fresh = AuditSampler(0.3, 3)
    assert [rec.auditor.sampler.sample(2 * HQ) for _ in range(50)] == [fresh.sample(2 * HQ) for _ in range(50)]


# ---- the compiled reference (csrc/cpu/audit_reference.cpp) --------------------------------------------------------
needs_compiled = pytest.mark.skipif(not cpu_kernels.audit_available(), reason="the audit's C++ reference is not built")


class CountingPageIn(PageInEngine):
    """A host page-in engine other than the stock one (as the fault injection's): counts the pages it is asked for."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.pages = 0

    def gather_kv(self, cache, block_ids, kv_heads):
        self.pages += int(block_ids.numel())
        return super().gather_kv(cache, block_ids, kv_heads)


def on_gpu(cache: LayerKVCache) -> LayerKVCache:
    """The cache as the compiled CUDA path reads it: pages on the GPU, the shadow in pinned host memory."""
    return LayerKVCache(cache.pages.cuda(), cache.shadow.pin_memory(), cache.layout, cache.keys_channel_major)


def channel_major(cache: LayerKVCache) -> LayerKVCache:
    """The same originals with the keys stored channel-major (vLLM's CPU key cache layout, the plugin's shadow)."""
    e, h, _, run, d = cache.shadow.shape
    shadow = cache.shadow.clone()
    shadow[:, :, 0] = cache.shadow[:, :, 0].transpose(-1, -2).contiguous().view(e, h, run, d)
    return LayerKVCache(cache.pages, shadow, cache.layout, keys_channel_major=True)


def stock_engine_that_never_gathers() -> PageInEngine:
    """The stock host engine (the compiled reference reads the shadow in place for it), with its gather disabled."""
    engine = PageInEngine("cpu")

    def refuse(*args):
        raise AssertionError("the stock engine's pages are read in place, never gathered")

    engine.gather_kv = refuse
    return engine


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("keys", ["token_major", "channel_major"])
@pytest.mark.parametrize("engine", ["stock", "other"])
def test_compiled_reference_is_float64_exact_attention(dtype, keys, engine):
    """Every (row, query head) pair against an independent float64 evaluation over the originals (``exact_attention``)
    and against the torch path: the output to 1e-12 of its scale, V_max and the |score| bound S to 1e-12 relative.
    Lengths on and off a block boundary and a 1-token row; the block table is wider than any row (as vLLM's) and
    its extra columns name other rows' blocks, which must not be read. With the stock engine nothing is gathered;
    with another engine exactly the pages of the rows' own columns are."""
    lens_ = (1, 16, 37, 160, 211)
    cs = cases("sink_and_recency", 40 + lens_.index(211), lens=lens_, dtype=dtype)
    cache, tables, lens = paged_batch(cs)
    if keys == "channel_major":
        cm = channel_major(cache)
        ids = tables[-1, :10].long()
        heads_kv = torch.arange(10) % HKV
        assert torch.equal(cm.shadow_pages(ids, heads_kv), cache.shadow_pages(ids, heads_kv))
        cache = cm
    wide = torch.cat([tables, tables.flip(0), tables], dim=1)  # columns past each row's length: other rows' blocks
    q = torch.stack([c.q for c in cs])
    scale = 1 / math.sqrt(D)
    rows = torch.arange(len(cs)).repeat_interleave(HQ)
    heads = torch.arange(HQ).repeat(len(cs))
    pagein = stock_engine_that_never_gathers() if engine == "stock" else CountingPageIn()
    out, v_max, s_max = reference_heads(q, cache, wide, lens, rows, heads, scale, pagein, compiled=True)
    assert out.dtype == v_max.dtype == s_max.dtype == torch.float64 and out.shape == (len(cs) * HQ, D)
    ref = exact64(cs, scale)[rows, heads]
    assert torch.allclose(out, ref, rtol=0, atol=1e-12 * float(ref.abs().max()))
    group = HQ // HKV
    for i, (r, h) in enumerate(zip(rows.tolist(), heads.tolist(), strict=True)):
        k, v, qh = cs[r].k[:, h // group].double(), cs[r].v[:, h // group].double(), cs[r].q[h].double()
        assert math.isclose(float(v_max[i]), float(v.norm(dim=-1).max()), rel_tol=1e-12)
        assert math.isclose(float(s_max[i]), float((k.abs() @ qh.abs()).max()) * scale, rel_tol=1e-12)
    if engine == "other":
        assert pagein.pages == HQ * sum(-(-t // 16) for t in lens_)
    torch_path = reference_heads(q, cache, wide, lens, rows, heads, scale, PageInEngine("cpu"), compiled=False)
    for ours, theirs in zip((out, v_max, s_max), torch_path, strict=True):
        assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-12 * float(theirs.abs().max()))


@needs_compiled
@pytest.mark.parametrize("engine", ["stock", "other"])
def test_compiled_reference_reads_nothing_past_the_length_and_propagates_non_finite_values(engine):
    """A NaN in a slot past a row's length (its last block's free slots) changes nothing; one in a token the row
    holds makes that KV head's outputs, V_max and S non-finite, which the audit counts as violations (rate 1)."""
    cfg = load_config("default", audit_rate=1.0)
    cs = cases("random", 5, lens=(37, 50))
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    q = torch.stack([c.q for c in cs])
    rows, heads = torch.tensor([0, 0, 1]), torch.tensor([0, 3, 0])
    pagein = stock_engine_that_never_gathers() if engine == "stock" else CountingPageIn()
    before = reference_heads(q, cache, tables, lens, rows, heads, 0.2, pagein, compiled=True)
    keys, values = cache._shadow_views()
    last = int(tables[0, 2])  # row 0: 37 tokens, its third block holds 5
    m = cache.sub_blocks
    keys[last // m, 0, last % m, 5:] = float("nan")
    values[last // m, 0, last % m, 5:] = float("nan")
    after = reference_heads(q, cache, tables, lens, rows, heads, 0.2, pagein, compiled=True)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    values[last // m, 0, last % m, 4, 0] = float("nan")  # token 36 of row 0, KV head 0 (query heads 0, 1)
    out, v_max, s_max = reference_heads(q, cache, tables, lens, rows, heads, 0.2, pagein, compiled=True)
    assert bool(out[0, 0].isnan()) and bool(v_max[0].isnan()) and bool(out[1:].isfinite().all())
    keys[last // m, 0, last % m, 4, 0] = math.copysign(math.inf, float(q[0, 0, 0]))  # query head 0's score: +inf
    out, v_max, s_max = reference_heads(q, cache, tables, lens, rows, heads, 0.2, pagein, compiled=True)
    assert bool(out[0].isnan().all()) and bool(s_max[0].isinf()) and bool(out[1:].isfinite().all())
    torch_path = reference_heads(q, cache, tables, lens, rows, heads, 0.2, PageInEngine("cpu"), compiled=False)
    assert torch.equal(out.isnan(), torch_path[0].isnan()) and torch.equal(s_max.isinf(), torch_path[2].isinf())
    rec = Recorder(cfg)
    rec.auditor._pageins[torch.device("cpu")] = pagein
    rec.call(cfg, cache, q, tables, lens, 0.2)
    o = rec.last()
    bad = (o.rows == 0) & (o.heads < HQ // HKV)
    assert bool(o.violated[bad].all()) and rec.auditor.violations >= int(bad.sum())


@needs_compiled
@pytest.mark.parametrize("preset", ["default", "loose"])
def test_the_audit_with_the_torch_reference_reaches_the_same_verdicts(preset):
    """The whole audit (error, allowance, verdict) with the compiled reference equals the one with the torch
    reference on a healthy and on a corrupted cache (value scales of row 0, KV head 0: the loose config lets them
    through to the audit), so the change of reference changed no decision."""
    cfg = load_config("default", audit_rate=1.0, audit_policy="log") if preset == "default" else _loose(False)
    cs = cases("sink_and_recency", 11, lens=(200, 211, 96))
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    q = torch.stack([c.q for c in cs])
    for corrupted in (False, True):
        if corrupted:
            corrupt(cache, tables[0, :12], 0, "value_scales")
        outcomes = []
        for compiled in (True, False):
            rec = Recorder(cfg)
            rec.auditor.compiled_reference = compiled
            rec.call(cfg, cache, q, tables, lens, 0.2)
            outcomes.append(rec.last())
        a, b = outcomes
        assert torch.equal(a.violated, b.violated) and torch.equal(a.rung, b.rung)
        assert torch.allclose(a.error, b.error, rtol=1e-9, atol=1e-12)
        assert torch.allclose(a.allowed, b.allowed, rtol=1e-12, atol=0)
        if not corrupted or preset == "loose":
            assert bool(a.violated.any()) == corrupted


# ---- the CUDA path, in Triton's interpreter ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("defer", [None, True], ids=["as_on_the_device", "deferred"])
def test_cuda_path_audit_and_device_fallback_in_the_interpreter(defer):
    """The op's CUDA path (interpreted on the CPU; compiled on a GPU): the audit's checks on its outputs, the
    fallback mask computed on the device and applied by the device rerun (``force_exact``, no ``exact_rows``).
    ``deferred``: the checks are read only when resolved later, as on CUDA pages, with the device check kernels
    (interpreted on the CPU)."""
    pytest.importorskip("triton")
    from certvllm.kv.cuda_pagein import CudaPageInEngine

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cs = cases("sink_and_recency", 11, lens=(40, 37))
    cache, tables, lens = paged_batch(cs, 16)
    corrupt(cache, tables[0, :2], 0, "value_scales")
    if dev.type == "cuda":
        cache = on_gpu(cache)
    q, tables, lens = torch.stack([c.q for c in cs]).to(dev), tables.to(dev), lens.to(dev)
    scale = 1 / math.sqrt(D)
    ref = exact64(cs, scale).to(dev)
    eng = CudaPageInEngine(dev)

    def audited(policy: str) -> tuple[Recorder, callable]:
        cfg = _loose(False).model_copy(update={"audit_policy": policy})
        rec = Recorder(cfg, defer=defer)
        if defer:
            rec.auditor.device_reference = True  # the device check kernels, as on CUDA pages

        def run(force):
            return certified_attention(q, cache, tables, lens, cfg, scale, backend="cuda", pagein=eng,
                                       force_exact=force)  # fmt: skip

        return rec, lambda: rec.auditor.run(0, q, cache, tables, lens, scale, run)

    rec, call = audited("log")
    res = call()
    rec.auditor.resolve(wait=True)  # on CUDA the checks land later; on the CPU they are read at once
    o = rec.last()
    check_against_exact(o, res, ref)
    assert set(o.rows[o.violated].tolist()) == {0} and rec.auditor.fallback_entries() == []

    rec, call = audited("fallback")
    call()
    rec.auditor.resolve(wait=True)
    assert len(rec.auditor.fallback_entries()) == 1
    again = call()  # the entry's mask, made on the device, goes to the op: row 0 recomputed by the device rerun
    assert bool((again.report.rung[0] == 4).all()) and bool((again.report.rung[1] <= 2).all())
    assert float((again.out[0].double() - ref[0]).norm(dim=-1).max()) < 1e-5 * float(ref.abs().max())
    rec.auditor.resolve(wait=True)
    assert not bool(rec.last().violated.any())  # the device rerun's rows pass their own audit
    assert (0, 1) in rec.forced


# ---- the device checks (triton_kernels/audit_check.py), in Triton's interpreter -----------------------------------
@pytest.mark.parametrize("keys", ["token_major", "channel_major"])
def test_device_checks_reach_the_torch_paths_verdicts(keys):
    """The two-kernel check the audit queues on CUDA pages (run here in the interpreter) against the CPU checks on
    the same call's output: every verdict column equal (error 1e-9 relative, allowance 1e-12), on a healthy and on
    a corrupted cache, with lengths on and off a block boundary, a 1-token row and a table wider than every row (its
    extra columns name other rows' blocks). Where the compiled reference is built (it reads nothing past a length;
    else the torch path, which does), once the call has run, the free slots of a row's last block are set to NaN:
    the kernels must not read past a row's length either."""
    pytest.importorskip("triton")
    cfg = _loose(False)
    cs = cases("sink_and_recency", 23, lens=(1, 16, 37, 211), dtype=torch.bfloat16)
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    if keys == "channel_major":
        cache = channel_major(cache)
    wide = torch.cat([tables, tables.flip(0), tables], dim=1)
    q = torch.stack([c.q for c in cs])
    if torch.cuda.is_available():
        cache, q, wide, lens = on_gpu(cache), q.cuda(), wide.cuda(), lens.cuda()
    nan_slots = cpu_kernels.audit_available() and not torch.cuda.is_available()
    scale = 1 / math.sqrt(D)
    pairs = list(range(len(cs) * HQ))
    for corrupted in (False, True):
        if corrupted:
            corrupt(cache, tables[3, :10], 0, "value_scales")
        res = certified_attention(q, cache, wide, lens, cfg, scale)
        if corrupted and nan_slots:
            keys_, values = cache._shadow_views()
            last, m = int(tables[2, 2]), cache.sub_blocks  # row 2: 37 tokens, its third block holds 5
            keys_[last // m, :, last % m, 5:] = float("nan")
            values[last // m, :, last % m, 5:] = float("nan")
        outcomes = []
        for device_checks in (True, False):
            rec = Recorder(cfg)
            rec.auditor.device_reference = device_checks
            rec.auditor.compiled_reference = None if device_checks or nan_slots else False
            checked = rec.auditor.queue_checks(q, cache, wide, lens, scale, res, pairs, torch.float32)
            assert rec.auditor._device_failure is None and len(checked) == (1 if device_checks else 10)
            outcomes.append(rec.auditor._outcome(_Pending(0, 0, DeferredRead(checked))))
        a, b = outcomes
        res = CertifiedOutput(res.out.cpu(), res.report)
        for name in ("rows", "heads", "rung", "violated", "lens", "key_block", "key_column"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert torch.allclose(a.error, b.error, rtol=1e-9, atol=1e-12)
        assert torch.allclose(a.allowed, b.allowed, rtol=1e-12, atol=0)
        assert torch.allclose(a.ratio, b.ratio, rtol=1e-9, atol=1e-12)
        check_against_exact(a, res, exact64(cs, scale))
        assert bool(a.violated.any()) == corrupted and bool(a.error.isfinite().all())


def test_device_checks_count_a_non_finite_token_as_a_violation():
    """A NaN in a token a row holds makes that KV head's checks violations in the device kernels."""
    pytest.importorskip("triton")
    cfg = load_config("default", audit_rate=1.0, audit_policy="log")
    cs = cases("random", 5, lens=(37, 50))
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    q = torch.stack([c.q for c in cs])
    if torch.cuda.is_available():
        cache, q, tables, lens = on_gpu(cache), q.cuda(), tables.cuda(), lens.cuda()
    rec = Recorder(cfg)
    rec.call(cfg, cache, q, tables, lens, 0.2)  # pages encoded before the shadow is spoilt: the output stays finite
    rec.auditor.resolve(wait=True)
    _, values = cache._shadow_views()
    last, m = int(tables[0, 2]), cache.sub_blocks
    values[last // m, 0, last % m, 4, 0] = float("nan")  # token 36 of row 0, KV head 0 (query heads 0, 1)
    rec.auditor.device_reference = True
    rec.call(cfg, cache, q, tables, lens, 0.2)
    rec.auditor.resolve(wait=True)
    o = rec.last()
    bad = (o.rows == 0) & (o.heads < HQ // HKV)
    assert bool(o.violated[bad].all()) and bool(o.ratio[bad].isinf().all()) and not bool(o.violated[~bad].any())


def test_waiting_for_queued_checks_never_holds_the_lock_the_layer_calls_take():
    """``resolve(wait=True)`` (the metrics' flusher thread) waits for the device values of the queued checks without
    holding the auditor's lock: a layer call on another thread (which takes the lock to queue its own checks and
    to read landed ones) must never wait on the device through it. A queued read whose wait checks that another
    thread can take the lock meanwhile stands in for a CUDA read."""
    import threading

    cfg = load_config("default", audit_rate=1.0, audit_policy="log")
    cs = cases("random", 5, lens=(37, 50))
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    q = torch.stack([c.q for c in cs])
    rec = Recorder(cfg, defer=True)
    rec.call(cfg, cache, q, tables, lens, 0.2)  # queued, not read (defer)
    pending = rec.auditor._pending[0]
    taken: list[bool] = []

    class SlowRead:
        def __init__(self, read) -> None:
            self.read, self.waited = read, False

        def wait(self) -> None:
            other = threading.Thread(target=lambda: taken.append(rec.auditor._lock.acquire(timeout=5) and
                                                                  (rec.auditor._lock.release() or True)))  # fmt: skip
            other.start()
            other.join()
            self.waited = True

        def done(self) -> bool:
            return self.waited

        def values(self):
            return self.read.values()

    pending.read = SlowRead(pending.read)
    outcomes = rec.auditor.resolve(wait=True)
    assert taken == [True] and len(outcomes) == 1 and rec.auditor.audited == 2 * HQ


def test_device_checks_in_chunks_equal_one_launch(monkeypatch):
    """Pairs checked in several launches (the partials' buffer capped, as at 128K with every head-step audited) give
    the verdict rows of one launch, bit for bit."""
    pytest.importorskip("triton")
    from certvllm.triton_kernels import audit_check

    cfg = load_config("default", audit_rate=1.0, audit_policy="log")
    cs = cases("sink_and_recency", 31, lens=(37, 160, 211))
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    q = torch.stack([c.q for c in cs])
    if torch.cuda.is_available():
        cache, q, tables, lens = on_gpu(cache), q.cuda(), tables.cuda(), lens.cuda()
    res = certified_attention(q, cache, tables, lens, cfg, 0.2)
    pairs = list(range(len(cs) * HQ))
    auditor = Auditor(cfg)
    auditor.device_reference = True
    whole = auditor.queue_checks(q, cache, tables, lens, 0.2, res, pairs, torch.float32)[0].cpu()
    splits = -(-tables.shape[1] // audit_check.COLUMNS_PER_SPLIT)
    monkeypatch.setattr(audit_check, "PARTIAL_BYTES", 5 * splits * (4 + D) * 8)  # 4 pairs per launch (even)
    chunked = auditor.queue_checks(q, cache, tables, lens, 0.2, res, pairs, torch.float32)[0].cpu()
    assert auditor._device_failure is None and torch.equal(whole, chunked)


@pytest.mark.parametrize("hq,hkv", [(HQ, HKV), (16, 2)])
def test_device_checks_of_any_pairs_come_back_in_the_callers_order(hq, hkv):
    """The partial kernel reads a KV head's pages once for the checked query heads of that (row, KV head): pairs in
    any order, a KV head with only some of its heads checked and a pair listed twice give, row for row in the
    caller's order, the verdicts of the torch path (the bar of
    ``test_device_checks_reach_the_torch_paths_verdicts``)."""
    pytest.importorskip("triton")
    cfg = load_config("default", audit_rate=1.0, audit_policy="log")
    gen = torch.Generator().manual_seed(37)
    cs = [make_case("sink_and_recency", t, hq, hkv, D, torch.float16, gen) for t in (37, 160, 211)]
    cache, tables, lens = paged_batch(cs, cfg.value_group_size)
    q = torch.stack([c.q for c in cs])
    if torch.cuda.is_available():
        cache, q, tables, lens = on_gpu(cache), q.cuda(), tables.cuda(), lens.cuda()
    res = certified_attention(q, cache, tables, lens, cfg, 0.2)
    g = hq // hkv  # 8 query heads per KV head: each KV head is read as two groups of 4 (HEADS_PER_GROUP)
    pairs = [2 * hq + 1, 0, hq + g, 2 * hq + 1, 1, 2 * hq, hq + 2 * g - 1, 0, g - 1, 2 * hq + g - 2]
    outcomes = []
    for device_checks in (True, False):
        auditor = Auditor(cfg)
        auditor.device_reference = device_checks
        checked = auditor.queue_checks(q, cache, tables, lens, 0.2, res, pairs, torch.float32)
        assert auditor._device_failure is None and len(checked) == (1 if device_checks else 10)
        outcomes.append(auditor._outcome(_Pending(0, 0, DeferredRead(checked))))
    a, b = outcomes
    assert a.rows.tolist() == [p // hq for p in pairs] and a.heads.tolist() == [p % hq for p in pairs]
    for name in ("rows", "heads", "rung", "violated", "lens", "key_block", "key_column"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.allclose(a.error, b.error, rtol=1e-9, atol=1e-12)
    assert torch.allclose(a.allowed, b.allowed, rtol=1e-12, atol=0)
    assert not bool(a.violated.any())


def test_pairs_are_grouped_by_kv_head_in_runs_of_at_most_four_query_heads():
    """``audit_check.group_pairs``: every pair lands in exactly one group, at the slot of its query head within the
    group's run, groups hold consecutive sorted positions, and a repeated pair opens a new group."""
    from certvllm.triton_kernels.audit_check import HEADS_PER_GROUP, group_pairs

    per, gp = 8, HEADS_PER_GROUP
    pairs = [17, 3, 8 * 3 + 5, 3, 0, 7, 8 * 2 + 4, 8 * 2 + 3]
    order, groups = group_pairs(pairs, per, gp)
    assert sorted(order) == list(range(len(pairs))) and [pairs[j] for j in order] == sorted(pairs)
    seen = []
    for key, g0, *slots in groups:
        assert g0 % gp == 0 and len(slots) == gp
        for j, p in enumerate(slots):
            if p >= 0:
                assert divmod(pairs[order[p]], per) == (key, g0 + j)
                seen.append(p)
    assert seen == list(range(len(pairs)))  # each sorted position once, groups consecutive
    assert [g[:2] for g in groups] == [[0, 0], [0, 0], [0, 4], [2, 0], [2, 4], [3, 4]]  # the repeated 3 opens a group
