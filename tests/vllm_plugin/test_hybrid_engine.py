"""End-to-end on vLLM (CPU): hybrid-attention models with ``--kv-cache-dtype certified``, certified pages on the
full-attention layers and native pages on the sliding-window ones (``certvllm.vllm_plugin.hybrid``).

Two real architectures that vLLM serves natively, tiny and with dummy weights (``load_format="dummy"``;
``hybrid_models.py``): Gemma 3 (6 layers, 5 sliding to 1 full, float32) and Command R7B's Cohere2 (8 layers, 3 to 1,
float16). Three engines per model, each in its own process (``certvllm.vllm_plugin.harness``), two at a time on
disjoint cores: ``auto``, ``default`` (the default preset) and ``forced`` (every certified head-step forced to rung 4,
exact attention over the host shadow with vLLM's own kernel). Every engine has a 64-block KV cache
(``num_gpu_blocks_override``) and serves the same five prompts, 24 greedy tokens each with their log-probabilities;
the last prompt (~190 tokens) is longer than the 64-token window, so the sliding layers drop blocks while the
certified layers attend to the whole context.

Checks: the certified engine serves and accounts for every head-step of its certified layers only (one per decode
token, certified layer and query head; prefill tokens exact, counted once); ``vllm:cert_layer_certified`` is 1
exactly on the full-attention layers; the host tier (``vllm:cert_host_tier_bytes``) holds the certified layers'
shadows only, ``blocks x shadow pages per pool block x B_c x H_kv x 2 x D x itemsize`` with the certified block
``B_c`` = 128·itemsize (vLLM scales it until the certified page is the native one) and one shadow page per
certified layer of the fullest KV cache group, not the figure of a model whose every layer is certified; certified
output agrees with ``auto`` by the engine tests' bar (at least half of the outputs identical) and, where tokens agree,
within LOGPROB_TOL nats per generated token; forced rung 4 is token-identical to ``auto`` with equal log-probabilities
(float32 and float16 run vLLM's same CPU kernel for ``auto`` and for the shadow, whatever the block size).

Dummy weights give nearly flat logits and attention whose output enters the residual through a ±1e-3 ``o_proj``, so
the agreement checks cannot see much of the quantization; what they can see is checked (the ladder certifies
head-steps, rung ≤ 2, on these contexts: ``test_vllm_engine`` measures certification against real weights).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from hybrid_models import HEAD_DIM, HEADS, KV_HEADS, MODELS, full_layers, write_model
from test_vllm_engine import agrees_enough

from certvllm.vllm_plugin.harness import cpu_binds, greedy_agreement, phase_deltas, run_engine

# pytest-xdist: with the other engine modules (tests/conftest.py, XDIST_GROUPS: "engines")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCKS, CPU_BLOCK, MAX_TOKENS, MAX_MODEL_LEN = 64, 128, 24, 512
LOGPROB_TOL = 0.01
"""Largest |log p_certified − log p_auto| (nats) of a generated token where both runs chose the same tokens so far."""
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Certified attention keeps an exact copy of every key and value block in host memory and quantized pages "
    "on the device; each decode step returns a proven bound or recomputes the head. " * 6,
]
KINDS = {"auto": ("auto", None), "default": ("certified", {}), "forced": ("certified", {"force_fallback": "layer"})}
_results: dict[tuple[str, str], Future] = {}
_threads: list[threading.Thread] = []


def _run(folder: Path, model: str, kind: str, bind: str | None) -> dict[str, Any]:
    kv, cert = KINDS[kind]
    requests = [{"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": True} for p in PROMPTS]
    spec = {"model": str(folder), "kv_cache_dtype": kv, "cert": cert, "phases": [{"requests": requests}],
            "engine": {"load_format": "dummy", "dtype": MODELS[model]["dtype"], "max_model_len": MAX_MODEL_LEN,
                       "num_gpu_blocks_override": BLOCKS}}  # fmt: skip
    result = run_engine(spec, env={"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else None)
    return {"outputs": result["outputs"], "metrics": phase_deltas(result)[0], "gauges": result["metrics"],
            "log": result["log"]}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def engines(tmp_path_factory) -> Any:
    """Write both models and start their six engines, two at a time (``harness.cpu_binds``)."""
    folders = {name: write_model(tmp_path_factory.mktemp(name) / name, name) for name in MODELS}
    order = [(model, kind) for model in MODELS for kind in ("default", "auto", "forced")]
    for key in order:
        _results[key] = Future()
    binds = cpu_binds(2)

    def slot(keys: list[tuple[str, str]], bind: str | None) -> None:
        for model, kind in keys:
            try:
                _results[model, kind].set_result(_run(folders[model], model, kind, bind))
            except BaseException as exc:  # handed to the tests that read this engine
                _results[model, kind].set_exception(exc)

    for i, bind in enumerate(binds):
        _threads.append(threading.Thread(target=slot, args=(order[i :: len(binds)], bind), name=f"hybrid-{i}"))
        _threads[-1].start()
    yield
    for thread in _threads:
        thread.join()


def run(model: str, kind: str) -> dict[str, Any]:
    return _results[model, kind].result()


def _counter(result: dict[str, Any], name: str, **labels: str) -> float:
    return result["metrics"].get(name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}", 0.0)


def _gauge(result: dict[str, Any], name: str, **labels: str) -> float:
    return result["gauges"][name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"]


def _tokens(result: dict[str, Any]) -> list[list[int]]:
    return [o["token_ids"] for o in result["outputs"]]


def _decode_head_steps(result: dict[str, Any], model: str) -> int:
    """Certified-layer head-steps of the decode tokens: every generated token after the first, per certified layer
    and query head (the native layers' attention is vLLM's own and counts nothing)."""
    return sum(len(o["token_ids"]) - 1 for o in result["outputs"]) * len(full_layers(model)) * HEADS


@pytest.mark.parametrize("model", list(MODELS))
def test_certified_serves_and_accounts_for_the_certified_layers_head_steps(model):
    cert = run(model, "default")
    assert [len(t) for t in _tokens(cert)] == [MAX_TOKENS] * len(PROMPTS)
    steps = {r: _counter(cert, "vllm:cert_head_steps_total", rung=str(r)) for r in range(5)}
    print(f"\n{model} head-steps by rung: {steps}")
    assert sum(steps.values()) == _decode_head_steps(cert, model)
    certified = steps[0] + steps[1] + steps[2]
    assert certified > 0 and steps[4] == 0
    assert _counter(cert, "vllm:cert_bound_relative_count") == certified
    # every prompt token is an exact prefill token, counted once (on the first certified layer: layer 0 slides)
    prompts = sum(o["prompt_tokens"] for o in cert["outputs"])
    assert _counter(cert, "vllm:cert_exact_tokens_total", reason="prefill") == prompts


@pytest.mark.parametrize("model", list(MODELS))
def test_metrics_and_log_show_which_layers_are_certified(model):
    cert = run(model, "default")
    layers = len(MODELS[model]["config"]["layer_types"])
    full = full_layers(model)
    got = {i: _gauge(cert, "vllm:cert_layer_certified", layer=str(i)) for i in range(layers)}
    assert got == {i: float(i in full) for i in range(layers)}
    native = ", ".join(str(i) for i in range(layers) if i not in full)
    line = next(x for x in cert["log"].splitlines() if "certvllm: hybrid KV cache:" in x)
    print(f"\n{line[line.index('certvllm:') :]}")
    assert f"certified layers {', '.join(map(str, full))}; native layers {native};" in line


@pytest.mark.parametrize("model", list(MODELS))
def test_host_tier_holds_the_certified_layers_only(model):
    cert = run(model, "default")
    itemsize = MODELS[model]["itemsize"]
    layers, full = len(MODELS[model]["config"]["layer_types"]), full_layers(model)
    block = CPU_BLOCK * itemsize  # the certified block: its page of 2·D bytes per token equals the native one
    # vLLM groups the layers in groups of the rarer kind's count: here every full layer is in one group
    slots = len(full)
    expected = BLOCKS * slots * block * KV_HEADS * 2 * HEAD_DIM * itemsize
    every_layer = BLOCKS * layers * CPU_BLOCK * KV_HEADS * 2 * HEAD_DIM * itemsize
    host = _gauge(cert, "vllm:cert_host_tier_bytes")
    print(f"\n{model}: host tier {host:.0f} bytes for {BLOCKS} blocks; all layers certified would be {every_layer}")
    assert host == expected != every_layer
    assert f"host tier shadows {BLOCKS} blocks" in cert["log"]
    assert f"{block}-token certified blocks; {slots} shadow page{'s' * (slots != 1)} per pool block" in cert["log"]


@pytest.mark.parametrize("model", list(MODELS))
def test_certified_agrees_with_auto(model):
    auto, cert = run(model, "auto"), run(model, "default")
    agree = greedy_agreement(_tokens(auto), _tokens(cert))
    print(f"\n{model} certified vs auto: {agree}")
    assert agrees_enough(agree)
    worst = 0.0
    for a, c in zip(auto["outputs"], cert["outputs"], strict=True):
        for x, y, lp_a, lp_c in zip(a["token_ids"], c["token_ids"], a["logprobs"], c["logprobs"], strict=True):
            if x != y:
                break
            worst = max(worst, abs(lp_a - lp_c))
    print(f"{model} largest |log-probability difference| where the tokens agree: {worst:.2e} nats")
    assert worst <= LOGPROB_TOL


@pytest.mark.parametrize("model", list(MODELS))
def test_forced_rung4_is_token_identical_to_auto(model):
    auto, forced = run(model, "auto"), run(model, "forced")
    assert _tokens(forced) == _tokens(auto)
    assert [o["logprobs"] for o in forced["outputs"]] == [o["logprobs"] for o in auto["outputs"]]
    assert _counter(forced, "vllm:cert_head_steps_total", rung="4") == _decode_head_steps(forced, model)
