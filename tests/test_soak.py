"""``benchmarks/soak.py``: the short soak of ``make test`` against the session's shared server, and its arithmetic.

The short soak runs 8 streaming clients for ~30 s against ``certified_server`` (tests/conftest.py; this test is
in its xdist group "server"), with short prompts (the shared server's prefill of a 2,000-token float32 prompt
takes seconds on this 2-core CPU, so long prompts would leave too few requests for a 30 s run) and a third of
the requests closed mid-stream. It checks what the full soak's targets check, except RSS growth (meaningless
over 30 s): no error other than the deliberate closes, the closes honoured by the server (it stopped generating for
them and nothing keeps running), no KV block in use after settling, the host tier unchanged, and the token
accounting.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_rss_summary_measures_after_warmup() -> None:
    soak = _soak()
    samples = [{"t": t, "rss": rss} for t, rss in [(0, 50.0), (10, 100.0), (20, 104.0), (30, 103.0), (40, 90.0)]]
    s = soak.rss_summary(samples, warm_t=10, end_t=30)
    assert s["first_after_warmup"] == 100.0 and s["last"] == 103.0 and s["max"] == 104.0
    assert s["growth"] == pytest.approx(0.03) and s["max_growth"] == pytest.approx(0.04)
    assert soak.rss_summary([], 0, 1)["growth"] is None


def test_plan_respects_the_limits() -> None:
    import random

    soak = _soak()
    cfg = soak.SoakConfig(min_prompt=8, max_tokens_lo=4, max_tokens_hi=32, abort_fraction=0.5)
    rng = random.Random(0)
    plans = [soak.plan(0, cfg, rng, max_prompt=500) for _ in range(2000)]
    assert all(8 <= p.target_prompt <= 500 and 4 <= p.max_tokens <= 32 for p in plans)
    aborts = [p for p in plans if p.abort_at is not None]
    assert 0.4 < len(aborts) / len(plans) < 0.6 and all(1 <= p.abort_at < p.max_tokens for p in aborts)
    assert {p.endpoint for p in plans} == {"chat", "completions"}
    assert min(p.target_prompt for p in plans) < 16 and max(p.target_prompt for p in plans) > 400  # log-uniform


@pytest.mark.vllm
@pytest.mark.slow
def test_short_soak_against_the_shared_server(certified_server: str) -> None:
    soak = _soak()
    cfg = soak.SoakConfig(clients=8, duration_s=30, abort_fraction=0.3, max_prompt=384, max_tokens_lo=8,
                          max_tokens_hi=40, warmup_fraction=0.2, rss_interval_s=2, drain_s=20,
                          settle_timeout_s=30, ramp_s=2)  # fmt: skip
    started = time.monotonic()
    doc = soak.run_soak(certified_server, cfg, log=lambda msg: None)
    elapsed = time.monotonic() - started
    req, acc, leak = doc["requests"], doc["accounting"], doc["leak_check"]
    summary = soak.table(doc)
    assert req["error"] == 0, (doc["errors"], doc["error_examples"], summary)
    assert req["completed"] >= 8 and req["aborted"] >= 2, summary
    # the closes were honoured: vLLM finished only the completed requests itself (it counts no aborts in
    # request_success_total), generated at most a couple of tokens per closed stream after the client went, and
    # nothing keeps running
    closed = req["aborted"] + req["cut"]
    assert acc["finished_stop_length_accounted"], summary
    assert 0 <= acc["abort_overrun_tokens"] <= 2 * closed, summary
    assert 0 <= acc["cert_head_steps_extra_steps"] <= 2 * closed, summary
    assert leak["settled"] and leak["leaked_blocks"] == 0 and leak["requests_running"] == 0, summary
    assert doc["targets"]["host_tier_unchanged"] and leak["leaked_shadow_pages"] == 0, summary
    assert acc["generation_tokens_consistent"], summary
    assert doc["ttft_s"]["p99"] >= doc["ttft_s"]["p50"] > 0 and doc["itl_s"]["p50"] > 0, summary
    assert acc["cert_head_steps"] > 0 and acc["cert_audit_violations"] == 0, summary
    assert doc["rss"]["samples"] > 0, summary  # the shared server runs on this machine: its RSS is sampled
    assert elapsed < 120, elapsed
