"""The kernel of exact dense decode attention (``certvllm.attention.dense_backend``): SDPA by default,
xformers only where importable, on CUDA, measured faster and in agreement with SDPA.

xformers is not installed here (nor on the H200 we measure on), so these tests inject a stand-in
``xformers.ops.memory_efficient_attention`` (plain torch math in xformers' grouped ``[B, M, G, H, K]``
layout, the keys and values broadcast over H) and, where the rule is about CUDA, let the device check accept the
CPU. The measurement reads a fake clock that each kernel advances by a stated cost, so "faster" and
"slower" do not depend on the load of the test machine.

Tolerance of "equals SDPA" and "keeps the float32 semantics" (``certvllm.testing.assert_within_lowp_error``,
FlashAttention's rule): a kernel's output is at most ``factor = 2`` times as far from the float64 exact
attention as the plain float32 einsum of the same attention is (worst element over the call's ``[H_q, D]``
output), plus ``atol = 2^-23·max|v|`` (a float32 ulp at the values' scale, the floor for a reference that
happens to be exact). At these inputs that allows ~1e-6, ten times less than the fixed rtol = 1e-4,
atol = 1e-5 it replaces (checked: stricter on every element). The wrong stand-in must be outside
``torch.allclose`` with rtol = 1e-4, atol = 1e-2 of SDPA (far outside: it forgets the scale).
"""

from __future__ import annotations

import logging
import math
import sys
import types

import pytest
import torch

from certvllm.attention import certified_decode, dense_backend, dense_decode
from certvllm.config import CertConfigError, make_config
from certvllm.kv.pagein import PageInEngine
from certvllm.testing import assert_within_lowp_error, exact_attention, make_case, paged_batch
from certvllm.vllm_plugin.exact import ExactAttention, ExactPlan

RTOL = 1e-4  # only for the "wrong" stand-in, which must be far outside it
FACTOR = 2.0
ULP = 2.0**-23  # atol per unit of max|v|


def float32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The plain float32 computation of what every kernel returns: ``[H_q, D]`` float32."""
    hkv = k.shape[1]
    qf, kf, vf = q.float().view(hkv, q.shape[0] // hkv, -1), k.float(), v.float()
    s = torch.einsum("kgd,tkd->kgt", qf, kf) * scale
    return torch.einsum("kgt,tkd->kgd", s.softmax(-1), vf).reshape(q.shape[0], -1)


def assert_float32_attention(out: torch.Tensor, q, k, v, scale: float, what: str) -> None:
    """``out`` is attention computed in float32: within FACTOR of the float32 einsum's error to float64."""
    atol = ULP * float(v.float().abs().max())
    assert_within_lowp_error(out, exact_attention(q, k, v, scale), float32_attention(q, k, v, scale),
                             factor=FACTOR, atol=atol, what=what)  # fmt: skip


class Clock:
    """The measurement's timer: time passes only when a kernel says it took some."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def clock(monkeypatch) -> Clock:
    dense_backend.reset()
    fake = Clock()
    monkeypatch.setattr(dense_backend, "_clock", fake)
    yield fake
    dense_backend.reset()


class StandIn:
    """``xformers.ops.memory_efficient_attention`` in plain torch: ``[B, M, G, H, K]`` in and out; each call
    advances ``clock`` by ``cost_s`` (binary fractions of a second: exact differences, so ties are ties)."""

    def __init__(self, clock: Clock, cost_s: float = 2.0**-10, wrong: bool = False) -> None:
        self.clock, self.cost_s, self.wrong, self.calls = clock, cost_s, wrong, 0

    def __call__(self, query, key, value, attn_bias=None, p=0.0, scale=None):
        assert attn_bias is None and p == 0.0
        assert query.dim() == key.dim() == value.dim() == 5 and query.shape[2:4] == key.shape[2:4] == value.shape[2:4]
        self.calls += 1
        self.clock.now += self.cost_s
        s = torch.einsum("bmghk,bnghk->bghmn", query, key) * (1.0 if self.wrong else scale)  # wrong: forgets the scale
        return torch.einsum("bghmn,bnghk->bmghk", s.softmax(dim=-1), value)


def _inject(monkeypatch, fn: StandIn) -> StandIn:
    package, ops = types.ModuleType("xformers"), types.ModuleType("xformers.ops")
    ops.memory_efficient_attention = fn
    package.ops = ops
    monkeypatch.setitem(sys.modules, "xformers", package)
    monkeypatch.setitem(sys.modules, "xformers.ops", ops)
    return fn


def _on_cuda(monkeypatch) -> None:
    """Let the selection treat CPU tensors as if they were on CUDA (the device check only)."""
    monkeypatch.setattr(dense_backend, "xformers_device_ok", lambda device: True)


def _sdpa_costs(monkeypatch, clock: Clock, cost_s: float) -> None:
    """SDPA as it is, but taking ``cost_s`` on the measurement's clock."""
    real = dense_backend.sdpa_decode

    def timed(q, k, v, scale):
        clock.now += cost_s
        return real(q, k, v, scale)

    monkeypatch.setitem(dense_backend.KERNELS, "sdpa", timed)


def _inputs(t: int = 100, hq: int = 8, hkv: int = 2, d: int = 64, dtype=torch.float16):
    gen = torch.Generator().manual_seed(t)
    q = torch.randn(hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    return q, k, v, 1 / math.sqrt(d)


def test_default_on_cpu_is_sdpa_even_with_xformers_importable(monkeypatch, clock):
    fake = _inject(monkeypatch, StandIn(clock))
    q, k, v, scale = _inputs()
    assert dense_backend.choose(q, k, v, scale) == "sdpa"  # backend "auto" by default
    assert torch.equal(dense_decode(q, k, v, scale), dense_backend.sdpa_decode(q, k, v, scale))
    assert fake.calls == 0 and dense_backend.decisions() == {}


def test_sdpa_kernel_keeps_the_float32_semantics():
    q, k, v, scale = _inputs(dtype=torch.bfloat16)
    out = dense_decode(q, k, v, scale)
    assert out.dtype == torch.float32 and out.shape == (8, 64)
    assert_float32_attention(out, q, k, v, scale, "sdpa on bfloat16 inputs")


@pytest.mark.parametrize("value", ["flash", "SDPA2", "1"])
def test_invalid_value_names_the_allowed_values(value):
    q, k, v, scale = _inputs()
    with pytest.raises(ValueError, match=rf"dense backend '{value}'.*auto, sdpa, xformers.*--cert-dense-backend"):
        dense_decode(q, k, v, scale, value)
    with pytest.raises(CertConfigError, match="dense_backend"):
        make_config(dense_backend=value)


def test_forced_xformers_without_xformers_raises_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "xformers", None)  # import fails as if not installed
    q, k, v, scale = _inputs()
    with pytest.raises(RuntimeError, match=r"xformers cannot be imported") as err:
        dense_decode(q, k, v, scale, "xformers")
    assert "pip install 'certvllm[xformers]'" in str(err.value)
    assert "--cert-dense-backend sdpa" in str(err.value)


def test_auto_without_xformers_is_sdpa_even_on_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "xformers", None)
    _on_cuda(monkeypatch)
    q, k, v, scale = _inputs()
    assert dense_backend.choose(q, k, v, scale) == "sdpa"


def test_forced_xformers_off_cuda_raises(monkeypatch, clock):
    _inject(monkeypatch, StandIn(clock))
    q, k, v, scale = _inputs()
    with pytest.raises(RuntimeError, match=r"the tensors' device cpu is not CUDA: xformers runs on CUDA only"):
        dense_decode(q, k, v, scale, "xformers")


def test_forced_xformers_is_used_and_equals_sdpa(monkeypatch, clock):
    fake = _inject(monkeypatch, StandIn(clock))
    _on_cuda(monkeypatch)
    q, k, v, scale = _inputs(hq=12, hkv=3)  # GQA, G = 4: query head h reads KV head h // 4
    out = dense_decode(q, k, v, scale, "xformers")
    assert fake.calls == 1 and out.dtype == torch.float32 and out.shape == (12, 64)
    assert_float32_attention(out, q, k, v, scale, "forced xformers")
    assert_float32_attention(dense_backend.sdpa_decode(q, k, v, scale), q, k, v, scale, "sdpa")


@pytest.mark.parametrize("xf_cost", [2.0**-8, 2.0**-9], ids=["slower", "equal"])
def test_slower_xformers_is_not_chosen(monkeypatch, caplog, clock, xf_cost):
    caplog.set_level(logging.INFO, logger="certvllm")
    fake = _inject(monkeypatch, StandIn(clock, cost_s=xf_cost))
    _on_cuda(monkeypatch)
    _sdpa_costs(monkeypatch, clock, 2.0**-9)
    q, k, v, scale = _inputs()
    assert dense_backend.choose(q, k, v, scale) == "sdpa"
    assert fake.calls == dense_backend.WARM_RUNS + dense_backend.TIMED_RUNS + 1  # timed, then compared
    assert list(dense_backend.decisions().values()) == ["sdpa"]
    assert "xformers not faster" in caplog.text


def test_faster_agreeing_xformers_is_chosen_cached_and_logged_once(monkeypatch, caplog, clock):
    caplog.set_level(logging.INFO, logger="certvllm")
    fake = _inject(monkeypatch, StandIn(clock))
    _on_cuda(monkeypatch)
    _sdpa_costs(monkeypatch, clock, 2.0**-9)
    q, k, v, scale = _inputs(t=100)
    out = dense_decode(q, k, v, scale)
    measured = dense_backend.WARM_RUNS + dense_backend.TIMED_RUNS + 1
    assert fake.calls == measured + 1  # the timing and comparison, then the call itself
    assert dense_backend.decisions() == {("cpu", torch.float16, 8, 2, 64, 128): "xformers"}
    assert_float32_attention(out, q, k, v, scale, "chosen xformers")

    q2, k2, v2, _ = _inputs(t=120)  # same shape class (T rounds up to 128): no new timing
    dense_decode(q2, k2, v2, scale)
    assert fake.calls == measured + 2
    assert caplog.text.count("uses xformers: faster and agrees") == 1

    q3, k3, v3, _ = _inputs(t=200)  # next class: measured again
    dense_decode(q3, k3, v3, scale)
    assert fake.calls == 2 * measured + 3 and len(dense_backend.decisions()) == 2


def test_faster_but_wrong_xformers_is_rejected(monkeypatch, caplog, clock):
    caplog.set_level(logging.INFO, logger="certvllm")
    fake = _inject(monkeypatch, StandIn(clock, wrong=True))
    _on_cuda(monkeypatch)
    _sdpa_costs(monkeypatch, clock, 2.0**-9)
    q, k, v, scale = _inputs()
    wrong = dense_backend.xformers_decode(q, k, v, scale)
    assert not torch.allclose(wrong, dense_backend.sdpa_decode(q, k, v, scale), rtol=RTOL, atol=1e-2)
    fake.calls = 0
    out = dense_decode(q, k, v, scale)
    assert fake.calls == dense_backend.WARM_RUNS + dense_backend.TIMED_RUNS + 1  # measured, never used
    assert list(dense_backend.decisions().values()) == ["sdpa"]
    assert "xformers disagrees with sdpa" in caplog.text
    assert torch.equal(out, dense_backend.sdpa_decode(q, k, v, scale))


def test_no_timing_during_cuda_graph_capture(monkeypatch, clock):
    fake = _inject(monkeypatch, StandIn(clock))
    _on_cuda(monkeypatch)
    _sdpa_costs(monkeypatch, clock, 2.0**-9)
    monkeypatch.setattr(dense_backend, "capturing", lambda device: True)
    q, k, v, scale = _inputs()
    assert dense_backend.choose(q, k, v, scale) == "sdpa"
    assert fake.calls == 0 and list(dense_backend.decisions().values()) == ["sdpa"]
    monkeypatch.setattr(dense_backend, "capturing", lambda device: False)
    assert dense_backend.choose(q, k, v, scale) == "sdpa" and fake.calls == 0  # the class keeps its kernel
    monkeypatch.setattr(dense_backend, "capturing", lambda device: True)
    assert dense_backend.choose(q, k, v, scale, "xformers") == "xformers" and fake.calls == 0


def test_rung3_heads_equal_dense_decode_with_the_chosen_kernel(monkeypatch, gen, clock):
    fake = _inject(monkeypatch, StandIn(clock))
    _on_cuda(monkeypatch)
    case = make_case("random", 300, 8, 2, 128, torch.bfloat16, gen)
    cfg = make_config(bound_tol=1e-9, dense_backend="xformers")  # every head to rung 3, recomputed by xformers
    res = certified_decode(case.q, case.k, case.v, cfg)
    assert (res.report.rung == 3).all() and fake.calls == 1
    dense = dense_decode(case.q, case.k, case.v, 1 / math.sqrt(128), "xformers")
    assert torch.equal(res.out, dense)
    assert_float32_attention(dense, case.q, case.k, case.v, 1 / math.sqrt(128), "rung-3 heads by xformers")


def test_plugin_decode_rows_off_cpu_use_dense_decode(monkeypatch, gen, clock):
    """The vLLM plugin's exact path off the CPU (``ExactAttention(on_cpu=False)``): one-token rows are
    ``dense_decode`` on the shadow originals, so they follow the same kernel choice."""
    fake = _inject(monkeypatch, StandIn(clock))
    _on_cuda(monkeypatch)
    cases = [make_case("random", t, 8, 2, 64, torch.float16, gen) for t in (40, 75)]
    cache, tables, lens = paged_batch(cases)
    exact = ExactAttention(8, 2, 64, torch.float16, 1 / 8, 16, on_cpu=False, dense_backend="xformers")
    plan = ExactPlan(torch.tensor([0, 1, 2], dtype=torch.int32), lens.to(torch.int32), tables.to(torch.int32))
    query = torch.stack([c.q for c in cases])
    out = torch.empty_like(query)
    exact.run(plan, query, cache, out, PageInEngine("cpu"))
    assert fake.calls == 2
    for i, c in enumerate(cases):
        assert torch.equal(out[i], dense_decode(c.q, c.k, c.v, 1 / 8, "xformers").to(torch.float16))


def test_startup_check_names_the_fix(monkeypatch, clock):
    """``check_request`` (what the vLLM plugin runs at startup): a bad value and a forced xformers off CUDA or
    without xformers fail before any request; auto and sdpa pass on any platform."""
    for value in ("auto", "sdpa"):
        assert dense_backend.check_request(value, on_cuda=False) == value
    with pytest.raises(ValueError, match="choose one of auto, sdpa, xformers"):
        dense_backend.check_request("flash", on_cuda=True)
    monkeypatch.setitem(sys.modules, "xformers", None)  # an import of xformers fails
    monkeypatch.setitem(sys.modules, "xformers.ops", None)
    dense_backend.reset()
    with pytest.raises(RuntimeError, match=r"pip install 'certvllm\[xformers\]'"):
        dense_backend.check_request("xformers", on_cuda=True)
    _inject(monkeypatch, StandIn(clock))
    dense_backend.reset()  # forget the failed import
    with pytest.raises(RuntimeError, match="this platform is not CUDA"):
        dense_backend.check_request("xformers", on_cuda=False)
    assert dense_backend.check_request("xformers", on_cuda=True) == "xformers"
