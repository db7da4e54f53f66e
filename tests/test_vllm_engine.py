"""End-to-end: vLLM (CPU) with ``kv_cache_dtype="certified"`` on the bundled SmolLM2-135M-Instruct.

Each engine runs in its own process (``certvllm.vllm_plugin.harness``); results are cached per module.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from certvllm.vllm_plugin.harness import run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "models" / "smollm2-135m-instruct")
LAYERS, HEADS = 30, 9

PROMPTS = [
    "The capital of France is",
    "Write a haiku about autumn leaves.",
    "def fibonacci(n):",
    "List three primary colors:",
    "The quick brown fox",
    "Explain what a neural network is in one sentence.",
    "Once upon a time, in a small village,",
    "The boiling point of water at sea level is",
    "Translate 'good morning' into Spanish:",
    "import numpy as np\n\ndef normalize(x):",
    "The largest planet in our solar system is",
    "Q: What is 12 times 12?\nA:",
    "A recipe for pancakes starts with",
    "The three laws of motion were formulated by",
    "SELECT name FROM users WHERE",
    "My favourite book is",
    "In 1969, astronauts",
    "The Pythagorean theorem states that",
    "Dear hiring manager,",
    "Photosynthesis is the process by which",
    "The main ingredients of bread are",
    "class Stack:\n    def __init__(self):",
    "The weather today is",
    "Shakespeare wrote",
]
PREFIX = (
    "Certified attention keeps an exact copy of every key and value block in host memory, and quantized "
    "pages on the device. Each decode step either returns a result with a proven error bound or recomputes "
    "the head exactly from the originals. "
) * 6
SHARED = [PREFIX + q for q in ("Summarize this.", "What is kept in host memory?", "Is the bound proven?")]


def _requests(prompts: list[str], max_tokens: int = 32) -> list[dict]:
    return [{"prompt": p, "max_tokens": max_tokens} for p in prompts]


@cache
def run(name: str) -> dict:
    """Named engine runs shared by the tests of this module."""
    forced = {"force_fallback": "layer"}
    features = {"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 64}
    tight = {"num_gpu_blocks_override": 6, "max_model_len": 640}
    long_requests = [{"prompt": p, "max_tokens": 200, "ignore_eos": True} for p in PROMPTS[:4]]
    specs = {
        "auto": dict(kv_cache_dtype="auto", requests=_requests(PROMPTS)),
        "forced": dict(kv_cache_dtype="certified", cert=forced, requests=_requests(PROMPTS)),
        "default": dict(kv_cache_dtype="certified", cert={}, requests=_requests(PROMPTS)),
        "auto_features": dict(kv_cache_dtype="auto", engine=features, requests=_requests(SHARED), batch=False),
        "forced_features": dict(kv_cache_dtype="certified", cert=forced, engine=features,
                                requests=_requests(SHARED), batch=False),
        "default_features": dict(kv_cache_dtype="certified", cert={"prefill": "certified"}, engine=features,
                                 requests=_requests(SHARED), batch=False),
        "default_no_prefix": dict(kv_cache_dtype="certified", cert={},
                                  engine={"enable_prefix_caching": False}, requests=_requests(SHARED), batch=False),
        "auto_preempt": dict(kv_cache_dtype="auto", engine=tight, requests=long_requests),
        "forced_preempt": dict(kv_cache_dtype="certified", cert=forced, engine=tight, requests=long_requests),
        "default_preempt": dict(kv_cache_dtype="certified", cert={}, engine=tight, requests=long_requests),
    }  # fmt: skip
    return run_engine({"model": MODEL, **specs[name]})


@pytest.fixture(scope="module", autouse=True)
def bundled_model():
    from certvllm.models import prepare_default_model

    prepare_default_model(MODEL)


def _tokens(result: dict) -> list[list[int]]:
    return [o["token_ids"] for o in result["outputs"]]


def _metric(result: dict, name: str, **labels: str) -> float:
    key = name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
    return result["metrics"].get(key, 0.0)


def _decode_head_steps(result: dict) -> int:
    """Query-head decode steps the run made: every generated token after the first, per layer and head."""
    return sum(max(len(o["token_ids"]) - 1, 0) for o in result["outputs"]) * LAYERS * HEADS


def test_offline_generation_with_certified_kv_cache():
    out = run("default")
    assert len(out["outputs"]) == len(PROMPTS)
    assert all(o["token_ids"] for o in out["outputs"])
    assert "Paris" in out["outputs"][0]["text"]


def test_forced_rung4_is_token_identical_to_auto():
    """Rung 4 runs vLLM's own CPU kernel on the shadow tier: exactly what `auto` computes."""
    assert _tokens(run("forced")) == _tokens(run("auto"))
    assert _metric(run("forced"), "vllm:cert_head_steps_total", rung="4") == _decode_head_steps(run("forced"))


def test_default_preset_matches_auto_and_every_head_step_is_accounted_for():
    auto, cert = run("auto"), run("default")
    pairs = list(zip(_tokens(auto), _tokens(cert), strict=True))
    exact = sum(a == c for a, c in pairs)
    same_tokens = sum(sum(x == y for x, y in zip(a, c, strict=False)) for a, c in pairs)
    total_tokens = sum(len(a) for a, _ in pairs)
    print(f"\ncertified vs auto: {exact}/{len(pairs)} outputs identical, {same_tokens}/{total_tokens} tokens in place")
    assert exact >= len(pairs) // 2  # quantization may flip marginal greedy choices, not most outputs

    steps = {r: _metric(cert, "vllm:cert_head_steps_total", rung=str(r)) for r in range(5)}
    assert sum(steps.values()) == _decode_head_steps(cert)
    # every certified head-step (rung ≤ 2) returned a bound within bound_tol·V_max (default preset: 0.1)
    certified = steps[0] + steps[1] + steps[2]
    assert _metric(cert, "vllm:cert_bound_relative_count") == certified
    assert _metric(cert, "vllm:cert_bound_relative_bucket", le="0.1") == certified
    # the rest was recomputed exactly, with a recorded reason
    reasons = ("rank", "boundary", "bound_tol")
    fallbacks = sum(_metric(cert, "vllm:cert_head_fallbacks_total", reason=r) for r in reasons)
    assert steps[3] == fallbacks
    assert steps[4] == 0 and _metric(cert, "vllm:cert_canary_violations_total") == 0
    assert _metric(cert, "vllm:cert_exact_tokens_total", reason="prefill") == sum(
        o["prompt_tokens"] for o in cert["outputs"]
    )


def test_prefix_caching_and_small_chunked_prefill():
    auto, forced, cert = run("auto_features"), run("forced_features"), run("default_features")
    assert _tokens(forced) == _tokens(auto)
    assert all(o["token_ids"] for o in cert["outputs"])
    # chunks after the first read cached blocks: with prefill: certified they ran the certified path
    steps = sum(_metric(cert, "vllm:cert_head_steps_total", rung=str(r)) for r in range(5))
    assert steps > _decode_head_steps(cert)
    assert _metric(auto, "vllm:prefix_cache_hits_total") > 0
    for result in (auto, forced, cert, run("default_no_prefix")):
        assert _metric(result, "vllm:kv_cache_usage_perc") == 0.0  # every block was freed


def test_preemption_recomputes_correctly_and_frees_everything():
    auto, forced, cert = run("auto_preempt"), run("forced_preempt"), run("default_preempt")
    assert _metric(auto, "vllm:num_preemptions_total") > 0
    assert _metric(forced, "vllm:num_preemptions_total") > 0
    assert _tokens(forced) == _tokens(auto)
    assert [len(t) for t in _tokens(cert)] == [200] * 4
    for result in (auto, forced, cert):
        assert _metric(result, "vllm:kv_cache_usage_perc") == 0.0


def test_certified_doubles_the_kv_token_capacity():
    """Same KV memory (VLLM_CPU_KVCACHE_SPACE=1): the certified page is half a BF16 page, so vLLM's
    planner fits about twice the tokens (startup line "CPU KV cache size: N tokens")."""
    auto, cert = run("auto")["kv_cache_tokens"], run("default")["kv_cache_tokens"]
    print(f"\nKV cache capacity: auto {auto:,} tokens, certified {cert:,} tokens ({cert / auto:.2f}x)")
    assert 1.9 <= cert / auto <= 2.1
