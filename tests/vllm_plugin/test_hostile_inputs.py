"""Issue 19, item 5: what probing the server as a hostile client found, one test (or more) per finding.

1. ``--cert-host-memory-gb`` below one full-length request: refused before vLLM starts, one line, exit 2.
2. ``vllm:cert_page_in_seconds`` grows on the CPU path when shadow pages are read.
3. A 1-token prompt is an exact prefill token, not certified head-steps.
4. The CPU's activation dtype: float32 where bf16 is not native, and certified is sound in float32.
5. ``/tokenize`` and ``/detokenize`` need the API key when one is set.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from certvllm.cli import _choose_cpu_dtype, api_keys, build_serve_args, main
from certvllm.config import load_config
from certvllm.vllm_plugin import preflight

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "models" / "smollm2-135m-instruct")
# the bundled model: 30 layers, 3 KV heads, D = 64
PER_TOKEN_BF16 = 30 * 3 * 2 * 64 * 2


# -- 1. the host tier's minimum ---------------------------------------------------------------------------------
def _fake_vllm_config(max_model_len: int, block_size: int, itemsize_dtype: torch.dtype, tp: int = 1) -> Any:
    model = SimpleNamespace(max_model_len=max_model_len, dtype=itemsize_dtype, get_num_layers=lambda p: 30,
                            get_num_kv_heads=lambda p: 3 // tp, get_head_size=lambda: 64)  # fmt: skip
    return SimpleNamespace(
        model_config=model,
        parallel_config=None if tp == 1 else SimpleNamespace(tensor_parallel_size=tp),
        cache_config=SimpleNamespace(block_size=block_size),
    )


@pytest.mark.parametrize("tp", [1, 3])
@pytest.mark.parametrize(("dtype_flag", "torch_dtype"), [([], torch.bfloat16), (["--dtype", "float32"], torch.float32)])
def test_the_early_minimum_is_the_one_vllms_check_applies(dtype_flag, torch_dtype, tp):
    """Also with tensor parallelism: each rank shadows its KV heads, the node's budget holds every rank's."""
    from certvllm.vllm_plugin import host_tier

    args = [MODEL, "--max-model-len", "8192", *dtype_flag] + (["--tensor-parallel-size", str(tp)] if tp > 1 else [])
    geometry = preflight.shadow_geometry(args, preflight.read_model_config(MODEL, args))
    vllm_config = _fake_vllm_config(8192, 16, torch_dtype, tp)
    per_block = host_tier.node_bytes_per_block(vllm_config)
    assert per_block == host_tier.shadow_bytes_per_block(vllm_config) * tp
    assert geometry.min_bytes == host_tier.min_blocks(vllm_config) * per_block
    assert geometry.per_token * tp == PER_TOKEN_BF16 * (2 if torch_dtype == torch.float32 else 1)
    # exactly the minimum passes both checks, one byte's worth less is refused by both
    gb = geometry.min_bytes / preflight.GIB
    assert preflight.host_tier_refusal(args, gb) is None
    host_tier.check_minimum(vllm_config, load_config(None, host_memory_gb=gb))
    assert preflight.host_tier_refusal(args, gb * 0.999) is not None
    with pytest.raises(preflight.StartupRefusal):
        host_tier.check_minimum(vllm_config, load_config(None, host_memory_gb=gb * 0.999))


def test_a_small_host_budget_is_refused_in_one_line_with_the_minimum_and_the_fix(capsys):
    argv = ["serve", MODEL, "--max-model-len", "8192", "--dtype", "bfloat16", "--cert-host-memory-gb", "0.01"]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "host" in line]
    minimum = preflight.gib_at_least(513 * 16 * PER_TOKEN_BF16)  # 513 blocks of 16 tokens: 0.18 GiB
    assert err == [
        f"certvllm: --cert-host-memory-gb 0.01 cannot hold the host shadow of one 8192-token request of {MODEL}: "
        f"that needs at least {minimum:.2f} GiB (513 blocks of 16 tokens x 22.5 KiB per token = 30 layers x 3 KV "
        f"heads x 2 x 64 x 2 bytes). Use --cert-host-memory-gb {minimum:.2f} or more, or a smaller --max-model-len."
    ]
    # the printed minimum is itself enough, and a shorter context needs less
    build_serve_args([MODEL, "--max-model-len", "8192", "--dtype", "bfloat16", "--cert-host-memory-gb", f"{minimum}"])
    build_serve_args([MODEL, "--max-model-len", "2k", "--dtype", "bfloat16", "--cert-host-memory-gb", "0.05"])


def test_the_refusal_comes_before_vllm_in_seconds_with_exit_code_2():
    script = Path(sys.executable).parent / "certvllm"
    start = time.perf_counter()
    proc = subprocess.run([str(script), "serve", MODEL, "--max-model-len", "8192", "--cert-host-memory-gb", "0.01"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    elapsed = time.perf_counter() - start
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "vllm" not in proc.stdout.lower()
    refusals = [line for line in proc.stderr.splitlines() if "--cert-host-memory-gb 0.01" in line]
    assert len(refusals) == 1 and refusals[0].startswith("certvllm: ")
    assert elapsed < 15  # vLLM's own config check came after ~14-20 s


def test_a_refusal_from_inside_vllms_config_check_is_one_line_and_exit_2(monkeypatch, capsys):
    """``plain --additional-config`` budgets that the early check cannot judge fail inside vLLM, wrapped in pydantic's
    ``ValidationError``: ``certvllm serve`` unwraps them."""
    from pydantic.dataclasses import dataclass

    from certvllm.vllm_plugin import _compat, launch

    @dataclass
    class Config:
        def __post_init__(self) -> None:
            raise preflight.StartupRefusal("certvllm: --cert-host-memory-gb 0.01 can shadow only 29 blocks ...")

    monkeypatch.setattr(_compat, "check_version", lambda: None)
    monkeypatch.setattr(launch, "serve", lambda args, extra: Config())
    assert main(["serve", "some/hub-model"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "certvllm: --cert-host-memory-gb 0.01 can shadow only 29 blocks ..."
    assert not any("Traceback" in line for line in err)


# -- 3. the 1-token prompt ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("query_len", "context", "settings", "expected"),
    [
        (1, 0, {}, "prefill"),  # a one-token prompt: the exact prefill, not a decode
        (1, 0, {"prefill": "certified"}, "prefill"),
        (5, 0, {}, "prefill"),
        (1, 7, {}, None),  # a decode step
        (4, 7, {}, "prefill_cached"),
        (4, 7, {"prefill": "certified"}, None),
        (1, 7, {"mode": "dense"}, "dense_mode"),
    ],
)
def test_exact_reason_of_each_kind_of_query(query_len, context, settings, expected):
    from certvllm.vllm_plugin.backend import exact_reason

    assert exact_reason(query_len, context, load_config(None, **settings)) == expected


def test_the_builder_serves_a_one_token_prompt_exactly_beside_a_decode():
    """``CertifiedMetadataBuilder.build`` on a step with a 1-token prompt (request 0) and a decode (request 1)."""
    from certvllm.vllm_plugin.backend import CertifiedMetadataBuilder
    from certvllm.vllm_plugin.exact import ExactAttention

    builder = object.__new__(CertifiedMetadataBuilder)
    builder.config = load_config(None)
    builder.runtime = SimpleNamespace(begin_step=lambda: None)
    builder._host_lens_exact = True
    builder.exact = ExactAttention(9, 3, 64, torch.float32, 1.0, 16, True)
    builder.kv_cache_spec = SimpleNamespace(block_size=16)
    builder.device = torch.device("cpu")
    i32 = torch.int32
    cm = SimpleNamespace(query_start_loc_cpu=torch.tensor([0, 1, 2], dtype=i32), num_reqs=2, num_actual_tokens=2,
                         seq_lens_cpu_upper_bound=torch.tensor([1, 9], dtype=i32),
                         block_table_tensor=torch.tensor([[0, 0], [1, 0]], dtype=i32))  # fmt: skip
    meta = builder.build(0, cm)
    assert meta.row_tokens.tolist() == [1] and meta.row_seq_lens.tolist() == [9]
    assert meta.exact_tokens.tolist() == [0] and not meta.exact_all
    assert meta.exact_counts == {"prefill": 1, "prefill_cached": 0, "dense_mode": 0}


# -- 4. the CPU's activation dtype -------------------------------------------------------------------------------
AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2\n"
AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512bw avx512_bf16 amx_tile\n"


def test_cpu_flags_are_read_from_cpuinfo():
    assert {"avx2", "fma"} <= preflight.cpu_flags(AVX2_ONLY) and "avx512_bf16" not in preflight.cpu_flags(AVX2_ONLY)
    assert "bf16" in preflight.cpu_flags("Features\t: fp asimd bf16 i8mm\n")


@pytest.mark.parametrize(
    ("args", "model_dtype", "cpuinfo", "expected"),
    [
        ([], "bfloat16", AVX2_ONLY, "float32"),
        ([], "float16", AVX2_ONLY, "float32"),
        ([], "bfloat16", AVX512_BF16, None),
        (["--dtype", "bfloat16"], "bfloat16", AVX2_ONLY, None),  # the user's choice is kept
        (["--dtype=auto"], "bfloat16", AVX2_ONLY, "float32"),
        ([], "float32", AVX2_ONLY, None),  # vLLM's own choice for a float32 model
        ([], None, AVX2_ONLY, None),
    ],
)
def test_the_activation_dtype_is_one_the_cpu_runs_natively(args, model_dtype, cpuinfo, expected):
    dtype, reason = preflight.cpu_activation_dtype(["m", *args], model_dtype, preflight.cpu_flags(cpuinfo))
    assert dtype == expected and reason


def test_serve_adds_float32_on_an_avx2_cpu_and_says_so(capsys):
    args = [MODEL, "--port", "1"]
    _choose_cpu_dtype(args, cpu_build=True, flags=preflight.cpu_flags(AVX2_ONLY))
    assert args[-2:] == ["--dtype", "float32"]
    assert "certvllm: activation dtype: float32 activations: the model is bfloat16" in capsys.readouterr().err
    native = [MODEL]
    _choose_cpu_dtype(native, cpu_build=True, flags=preflight.cpu_flags(AVX512_BF16))
    assert native == [MODEL]
    gpu = [MODEL]
    _choose_cpu_dtype(gpu, cpu_build=False, flags=set())
    assert gpu == [MODEL]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_certified_is_sound_with_float32_activations(backend):
    from certvllm.attention import cpu_fused
    from certvllm.testing import FAMILIES, check_soundness, make_case

    if backend == "cpu":
        assert cpu_fused.cpu_kernel.available(), "the CPU kernel did not build"
    gen = torch.Generator().manual_seed(0)
    for family in FAMILIES:
        cases = [make_case(family, t, 12, 3, 64, torch.float32, gen) for t in (3, 16, 47, 300, 777)]
        res = check_soundness(cases, load_config("default"), backend=backend)
        assert res.violations == 0 and res.dense_mismatch == 0, family
        assert int((res.rung <= 2).sum()) > 0, family  # certified, not only fallbacks


def test_the_certified_backend_accepts_float32():
    from certvllm.vllm_plugin.backend import CertifiedAttentionBackend

    assert CertifiedAttentionBackend.supports_dtype(torch.float32)


# -- 5. the tokenizer routes and the API key ---------------------------------------------------------------------
def _call(app: Any, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    """The status an ASGI ``app`` answers a POST to ``path`` with."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers,
             "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("t", 80)}  # fmt: skip
    asyncio.run(app(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_the_tokenizer_routes_need_the_key_and_the_rest_passes(monkeypatch):
    from certvllm.vllm_plugin import auth

    async def inner(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    monkeypatch.setattr(auth, "_KEY_HASHES", [])
    with pytest.raises(RuntimeError, match="has no API key in this process"):
        auth.GuardTokenizerRoutes(inner)
    auth.set_api_keys(["k1", "k2"])
    app = auth.GuardTokenizerRoutes(inner)
    for path in ("/tokenize", "/detokenize", "/tokenizer_info"):
        assert _call(app, path, []) == 401
        assert _call(app, path, [(b"authorization", b"Bearer wrong")]) == 401
        assert _call(app, path, [(b"authorization", b"Bearer k2")]) == 200
    for path in ("/health", "/metrics", "/v1/models", "/tokenizefoo"):  # /v1: vLLM's own check
        assert _call(app, path, []) == 200


def test_serve_with_an_api_key_adds_the_guard(monkeypatch):
    from certvllm.vllm_plugin import auth

    monkeypatch.setattr(auth, "_KEY_HASHES", [])
    assert api_keys(["m", "--api-key", "a", "b", "--port", "1", "--api-key=c"]) == ["a", "b", "c"]
    args, _ = build_serve_args(["m", "--api-key", "secret"])
    assert args[-2:] == ["--middleware", auth.MIDDLEWARE_PATH] and auth._KEY_HASHES
    args, _ = build_serve_args(["m"])
    assert "--middleware" not in args
    args, _ = build_serve_args(["m", "--api-key", "secret", "--api-server-count", "2"])
    assert "--middleware" not in args  # the key cannot reach the other API server processes
