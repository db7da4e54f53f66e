"""End-to-end: vLLM (CPU) with ``kv_cache_dtype="certified"`` on the bundled SmolLM2-135M-Instruct.

Each engine runs in its own process (``certvllm.vllm_plugin.harness``) and serves several request
phases in sequence; one engine per configuration, shared by the module's tests. Metric assertions read
what each phase added to the counters (``harness.phase_deltas``) and the gauges as they stood after the
phase. The engines start together at the first test that needs one, two at a time on disjoint cores
(vLLM's CPU worker computes on one core and leaves the other to its scheduler, mostly idle).

Six engines cover every test: ``auto``, ``forced`` and ``default`` at the default engine settings (the
capacity comparison needs vLLM's own block count, so these three cannot share the small engines), and
``auto_small``, ``forced_small`` and ``default_small`` with a 6-block cache (preemption) plus prefix caching
and 64-token chunked prefill (the SHARED prompts run one at a time, taking 3 of the 6 blocks, so they are
never preempted). Merged configurations differ only where the assertions do not look:

* ``default`` runs with prefix caching off, serving both PROMPTS and the prefix-caching-off SHARED run: no
  PROMPTS request (prompt + 32 tokens) fills a 128-token block, so prefix caching never serves them; a last
  phase aborts two streams (ABORTS);
* ``default_small`` has ``prefill: certified`` (the prefix-caching test needs it); its preemption run only
  checks lengths and freed blocks, and its recomputed prefills then take the certified path.

Every engine runs the model in float16 (``ENGINE_DTYPE``): on CPUs with AMX tiles vLLM's ``auto`` computes
bfloat16 attention with an AMX kernel whose cache layout the shadow tier cannot hold (``exact.shadow_isa``), so a
forced rung 4 over the shadow is exact but not bit-identical to bfloat16 ``auto`` there; in float16 both run
vLLM's same kernel on every x86 CPU, which the token-identity tests need (as ``test_tensor_parallel``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from certvllm.vllm_plugin.harness import cpu_binds, greedy_agreement, phase_deltas, run_engine

# pytest-xdist: one worker runs this module and the evaluation smoke test (tests/conftest.py, XDIST_GROUPS)
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
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


# two streams cut after 4 and 8 tokens and one that outlives them (its steps refresh vLLM's KV gauges)
ABORTS = {"requests": [{"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "abort_after_tokens": 4},
                       {"prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "abort_after_tokens": 8},
                       {"prompt": PROMPTS[2], "max_tokens": 48, "ignore_eos": True}]}  # fmt: skip


def _requests(prompts: list[str], max_tokens: int = 32) -> list[dict]:
    return [{"prompt": p, "max_tokens": max_tokens} for p in prompts]


# every engine of the module, in the order the tests first need them (see _start_engines)
ENGINE_ORDER = ("default", "forced", "auto", "auto_small", "forced_small", "default_small")
_results: dict[str, Future] = {}
_slots: list[threading.Thread] = []
_stop = threading.Event()


ENGINE_DTYPE = "float16"


def _spec(name: str) -> dict:
    forced = {"force_fallback": "layer"}
    small = {"num_gpu_blocks_override": 6, "max_model_len": 640,  # preemption, and
             "enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 64}  # fmt: skip
    prompts = {"requests": _requests(PROMPTS)}
    shared = {"requests": _requests(SHARED), "batch": False}
    long_requests = {"requests": [{"prompt": p, "max_tokens": 200, "ignore_eos": True} for p in PROMPTS[:4]]}
    specs = {
        "auto": dict(kv_cache_dtype="auto", phases={"prompts": prompts}),
        "forced": dict(kv_cache_dtype="certified", cert=forced, phases={"prompts": prompts}),
        "default": dict(kv_cache_dtype="certified", cert={}, engine={"enable_prefix_caching": False},
                        phases={"prompts": prompts, "shared": shared, "abort": ABORTS}),
        "auto_small": dict(kv_cache_dtype="auto", engine=small, phases={"shared": shared, "preempt": long_requests}),
        "forced_small": dict(kv_cache_dtype="certified", cert=forced, engine=small,
                             phases={"shared": shared, "preempt": long_requests}),
        "default_small": dict(kv_cache_dtype="certified", cert={"prefill": "certified"}, engine=small,
                              phases={"shared": shared, "preempt": long_requests}),
    }  # fmt: skip
    spec = specs[name]
    spec["engine"] = {**spec.get("engine", {}), "dtype": ENGINE_DTYPE}
    return spec


def _run(name: str, bind: str | None) -> dict[str, dict]:
    """One engine process: each phase's outputs, counter deltas and gauges."""
    spec = _spec(name)
    names = list(spec["phases"])
    result = run_engine({"model": MODEL, **spec, "phases": list(spec["phases"].values())},
                        env={"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else None)  # fmt: skip
    phases = {}
    for phase_name, phase, delta in zip(names, result["phases"], phase_deltas(result), strict=True):
        phases[phase_name] = {"outputs": phase["outputs"], "metrics": delta, "gauges": phase["metrics"],
                              "kv_cache_tokens": result["kv_cache_tokens"]}  # fmt: skip
    return phases


def _start_engines() -> None:
    """Start every engine of the module, as many at once as the CPUs allow (``harness.cpu_binds``: on two
    cores, two engines, one core each): slot ``i`` runs ``ENGINE_ORDER[i::slots]`` one after the other."""
    binds = cpu_binds(2)
    for name in ENGINE_ORDER:
        _results[name] = Future()

    def slot(names: tuple[str, ...], bind: str | None) -> None:
        for name in names:
            if _stop.is_set():
                _results[name].set_exception(RuntimeError("the module finished before this engine started"))
                continue
            try:
                _results[name].set_result(_run(name, bind))
            except BaseException as exc:  # handed to the test that reads this engine
                _results[name].set_exception(exc)

    for i, bind in enumerate(binds):
        _slots.append(threading.Thread(target=slot, args=(ENGINE_ORDER[i :: len(binds)], bind), name=f"engines-{i}"))
        _slots[-1].start()


def engine(name: str) -> dict[str, dict]:
    """The phases of one shared engine (all of the module's engines start at the first call)."""
    if not _results:
        _start_engines()
    return _results[name].result()


def run(name: str, phase: str) -> dict:
    """One phase of a shared engine: ``outputs``, ``metrics`` (what the phase added), ``gauges`` (after it)."""
    return engine(name)[phase]


@pytest.fixture(scope="module", autouse=True)
def bundled_model():
    from certvllm.models import prepare_default_model

    prepare_default_model(MODEL)
    yield
    _stop.set()  # engines not started yet are not started; running ones finish (run_engine cleans up)
    for thread in _slots:
        thread.join()


def _tokens(result: dict) -> list[list[int]]:
    return [o["token_ids"] for o in result["outputs"]]


def _key(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


def _metric(result: dict, name: str, **labels: str) -> float:
    """How much a counter (or histogram series) grew during the phase."""
    return result["metrics"].get(_key(name, labels), 0.0)


def _gauge(result: dict, name: str, **labels: str) -> float:
    """A gauge as it stood after the phase (the series must exist)."""
    return result["gauges"][_key(name, labels)]


def agrees_enough(agree: dict[str, int]) -> bool:
    """The certified-vs-auto bar (:func:`greedy_agreement`): quantization may flip marginal greedy choices,
    not most outputs, so at least half of the outputs are identical (the GPU tests use the same bar)."""
    return agree["identical"] >= agree["outputs"] // 2


def _decode_head_steps(result: dict) -> int:
    """Query-head decode steps the run made: every generated token after the first, per layer and head."""
    return sum(max(len(o["token_ids"]) - 1, 0) for o in result["outputs"]) * LAYERS * HEADS


def test_offline_generation_with_certified_kv_cache():
    out = run("default", "prompts")
    assert len(out["outputs"]) == len(PROMPTS)
    assert all(o["token_ids"] for o in out["outputs"])
    assert "Paris" in out["outputs"][0]["text"]


def test_forced_rung4_is_token_identical_to_auto():
    """Rung 4 runs vLLM's own CPU kernel on the shadow tier: exactly what `auto` computes."""
    forced = run("forced", "prompts")
    assert _tokens(forced) == _tokens(run("auto", "prompts"))
    assert _metric(forced, "vllm:cert_head_steps_total", rung="4") == _decode_head_steps(forced)


def test_default_preset_matches_auto_and_every_head_step_is_accounted_for():
    auto, cert = run("auto", "prompts"), run("default", "prompts")
    agree = greedy_agreement(_tokens(auto), _tokens(cert))
    print(f"\ncertified vs auto: {agree['identical']}/{agree['outputs']} outputs identical, "
          f"{agree['tokens_in_place']}/{agree['tokens']} tokens in place")  # fmt: skip
    assert agrees_enough(agree)

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
    # the same engine's next phase (SHARED, one whole prefill each) is accounted for on its own
    shared = run("default", "shared")
    shared_steps = sum(_metric(shared, "vllm:cert_head_steps_total", rung=str(r)) for r in range(5))
    assert shared_steps == _decode_head_steps(shared)
    assert _metric(shared, "vllm:cert_exact_tokens_total", reason="prefill") == sum(
        o["prompt_tokens"] for o in shared["outputs"]
    )


def test_prefix_caching_and_small_chunked_prefill():
    auto, forced, cert = run("auto_small", "shared"), run("forced_small", "shared"), run("default_small", "shared")
    assert _tokens(forced) == _tokens(auto)
    assert all(o["token_ids"] for o in cert["outputs"])
    # chunks after the first read cached blocks: with prefill: certified they ran the certified path
    steps = sum(_metric(cert, "vllm:cert_head_steps_total", rung=str(r)) for r in range(5))
    assert steps > _decode_head_steps(cert)
    assert _metric(auto, "vllm:prefix_cache_hits_total") > 0
    for result in (auto, forced, cert, run("default", "shared")):
        assert _gauge(result, "vllm:kv_cache_usage_perc") == 0.0  # every block was freed


def test_preemption_recomputes_correctly_and_frees_everything():
    auto, forced, cert = run("auto_small", "preempt"), run("forced_small", "preempt"), run("default_small", "preempt")
    assert _metric(auto, "vllm:num_preemptions_total") > 0
    assert _metric(forced, "vllm:num_preemptions_total") > 0
    assert _tokens(forced) == _tokens(auto)
    assert [len(t) for t in _tokens(cert)] == [200] * 4
    for result in (auto, forced, cert):
        assert _gauge(result, "vllm:kv_cache_usage_perc") == 0.0


def test_aborted_requests_free_their_blocks():
    """Requests aborted mid-stream (the harness's ``abort_after_tokens``) leave no block held; the shadow tier
    is indexed by block, so no block held means no shadow page held."""
    out = run("default", "abort")
    assert [o["aborted"] for o in out["outputs"]] == [True, True, False]
    first, second = (len(o["token_ids"]) for o in out["outputs"][:2])
    assert 4 <= first < 200 and 8 <= second < 200
    assert len(out["outputs"][2]["token_ids"]) == 48
    assert _gauge(out, "vllm:kv_cache_usage_perc") == 0.0
    assert _gauge(out, "vllm:num_requests_running") == 0.0


def test_certified_doubles_the_kv_token_capacity():
    """Same KV memory (VLLM_CPU_KVCACHE_SPACE=1): the certified page is half a BF16 page, so vLLM's
    planner fits about twice the tokens (startup line "CPU KV cache size: N tokens")."""
    auto, cert = run("auto", "prompts")["kv_cache_tokens"], run("default", "prompts")["kv_cache_tokens"]
    print(f"\nKV cache capacity: auto {auto:,} tokens, certified {cert:,} tokens ({cert / auto:.2f}x)")
    assert 1.9 <= cert / auto <= 2.1
