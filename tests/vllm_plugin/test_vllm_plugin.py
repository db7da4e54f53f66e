"""Plugin registration, routing checks and startup errors (each names the fix)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from certvllm.cli import build_serve_args, main, split_cert_args

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "models" / "smollm2-135m-instruct")
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PATH": "/usr/bin:/bin"}


def test_cert_flags_fold_into_additional_config():
    args, extra = build_serve_args(
        ["m", "--port", "9", "--cert-config", "strict", "--cert-v-tol=0.02", "--additional-config", '{"x": 1}']
    )
    assert args == ["m", "--port", "9", "--kv-cache-dtype", "certified"]
    assert extra == {"x": 1, "certvllm": {"preset": "strict", "v_tol": 0.02}}
    passthrough, preset, raw = split_cert_args(["m", "--kv-cache-dtype", "auto", "--cert-rank-check", "false"])
    assert passthrough == ["m", "--kv-cache-dtype", "auto"] and preset is None and raw == {"rank_check": "false"}


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["serve", "m", "--cert-bogus", "1"], "unknown flag --cert-bogus; certvllm flags are --cert-config"),
        (["serve", "m", "--cert-v-tol", "-1"], "v_tol: Input should be greater than or equal to 0"),
        (["serve", "m", "--cert-config", "nope"], "unknown certvllm preset 'nope'; choose one of"),
        (["serve", "m", "--cert-tau-cov"], "--cert-tau-cov needs a value"),
        (["serve"], "certvllm serve needs a model"),
        (["frobnicate"], "unknown command 'frobnicate'"),
    ],
)
def test_bad_command_lines_exit_2_with_the_fix(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_register_is_idempotent_and_routes_certified():
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from certvllm.vllm_plugin import BACKEND_PATH, register

    register()
    register()
    assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH
    assert STR_DTYPE_TO_TORCH_DTYPE["certified"] is torch.uint8
    from vllm.config import CacheConfig

    assert CacheConfig(cache_dtype="certified").cache_dtype == "certified"


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"use_mla": True}, "MLA attention"),
        ({"has_sliding_window": True}, "sliding-window layers"),
        ({"head_size": 48}, "head size 48 is not supported"),
        ({"dtype": torch.float64}, "use --dtype bfloat16, float16 or float32"),
        ({"has_sink": True}, "attention sinks"),
    ],
)
def test_unsupported_layers_are_refused_with_the_fix(change, needle):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from certvllm.vllm_plugin import register, routing

    register()
    cfg = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="certified", block_size=128)
    routing._check_layer(cfg, None)  # a supported layer passes
    with pytest.raises(ValueError, match=needle) as info:
        routing._check_layer(cfg._replace(**change), None)
    assert "--kv-cache-dtype auto" in str(info.value)


def test_unsupported_vllm_versions_are_refused(monkeypatch):
    import vllm

    from certvllm.vllm_plugin import _compat

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    supported = r"supports vLLM 0.26, 0.32 and 0.33 \(range 0.26–0.33\), found 0.31.2"
    with pytest.raises(_compat.UnsupportedVllmError, match=supported):
        _compat.check_version()


@contextlib.contextmanager
def _environ_kept() -> Iterator[None]:
    """vLLM's CPU platform exports settings into ``os.environ`` while it builds a config (LD_PRELOAD,
    LOCAL_WORLD_SIZE, ...); put the test process's environment back afterwards."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _engine_config(model: str = MODEL, max_model_len: int = 2048, **engine: Any) -> Any:
    """The ``VllmConfig`` that ``LLM(model, kv_cache_dtype="certified", ...)`` builds first, in this process.

    Building it runs the platform's config check, where the plugin makes its startup checks
    (``routing._prepare_certified``: preset, block size, host-tier budget, dense backend), exactly as in the
    engine's own process, before any engine process would be started."""
    from vllm.engine.arg_utils import EngineArgs

    from certvllm.vllm_plugin import register

    register()
    args = EngineArgs(model=model, kv_cache_dtype="certified", enforce_eager=True, max_model_len=max_model_len,
                      **engine)  # fmt: skip
    with _environ_kept():
        return args.create_engine_config()


def _startup_refusal(**engine: Any) -> str:
    """The error with which building the engine config refuses ``engine`` (``_engine_config``)."""
    with pytest.raises(ValueError) as info:  # pydantic's ValidationError is a ValueError
        _engine_config(**engine)
    return str(info.value)


def test_host_budget_too_small_refuses_to_start_naming_the_flag():
    out = _startup_refusal(additional_config={"certvllm": {"host_memory_gb": 0.0001}})
    assert "Use --cert-host-memory-gb" in out and "certvllm: --cert-host-memory-gb 0.0001 can shadow only" in out


def test_bad_dense_backend_fails_at_startup():
    """``dense_backend`` is a config field: a bad value fails the config's validation, and a forced xformers
    that cannot run here fails the plugin's startup check, both before any engine process starts."""
    out = _startup_refusal(additional_config={"certvllm": {"dense_backend": "flash"}})
    assert "dense_backend" in out and "--cert-dense-backend" in out
    with pytest.raises(RuntimeError, match="--cert-dense-backend xformers, but"):
        _engine_config(additional_config={"certvllm": {"dense_backend": "xformers"}})


def test_block_size_not_a_multiple_of_16_is_refused():
    out = _startup_refusal(block_size=24)
    assert "--block-size 24 cannot be used with --kv-cache-dtype certified" in out


def test_unknown_preset_in_additional_config_fails_at_startup():
    out = _startup_refusal(additional_config={"certvllm": {"preset": "nope"}})
    assert "unknown certvllm preset 'nope'" in out


def test_model_with_unsupported_head_size_fails_at_startup(tmp_path):
    """A real (tiny, random) LLaMA with head_dim 48: the engine refuses it with the fix.

    The refusal comes when the model's first attention layer is built: vLLM's ``Attention`` asks the
    backend selector, which the plugin routes through its layer check. Here the same layer is built from
    the engine config of the saved model, in this process (no model weights or engine process needed)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    from certvllm.models import prepare_default_model

    prepare_default_model(MODEL)
    tok = AutoTokenizer.from_pretrained(MODEL)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=192, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                      max_position_embeddings=512)  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    vllm_config = _engine_config(str(tmp_path), max_model_len=512)
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    heads, kv_heads = model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel)
    assert (model.get_head_size(), model.dtype) == (48, torch.bfloat16)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model.dtype)  # as vLLM's model loader does while it builds the layers
    try:
        with set_current_vllm_config(vllm_config), pytest.raises(ValueError) as info:
            Attention(heads, model.get_head_size(), model.get_head_size() ** -0.5, num_kv_heads=kv_heads,
                      cache_config=vllm_config.cache_config, prefix="model.layers.0.self_attn.attn")  # fmt: skip
    finally:
        torch.set_default_dtype(default_dtype)
    assert "head size 48 is not supported" in str(info.value)
    assert "Serve it with --kv-cache-dtype auto" in str(info.value)
    json.dumps(cfg.to_dict())  # the config was well formed


@pytest.mark.vllm
def test_the_vllm_script_works_under_vllm_cpu():
    """vllm-cpu's own script looks up the distribution "vllm"; the CPU install repoints it."""
    vllm_script = Path(sys.executable).parent / "vllm"
    proc = subprocess.run([str(vllm_script), "--version"], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith("0.3")


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graphs", "eager_with_prefetch"])
@pytest.mark.parametrize("fraction", [0.0, 0.0625, 0.25, 1.0])
@pytest.mark.parametrize(("layers", "kv_heads", "block_size", "head_size", "itemsize"),
                         [(30, 3, 16, 64, 2), (32, 8, 16, 128, 2), (32, 8, 64, 128, 2), (2, 1, 32, 64, 4)])  # fmt: skip
def test_promotion_pool_fits_in_the_planned_kv_memory(
    fraction: float, layers: int, kv_heads: int, block_size: int, head_size: int, itemsize: int, graphs: bool
) -> None:
    """On CUDA the block count leaves room for every layer's promotion pool (as PromotionCache sizes it) and
    keeps as many blocks as fit: pages + pools + generation counters + the step prefetch's ring, page lists
    and grid maps (when it runs: ``cuda_graphs`` off) ≤ the planned pages' bytes."""

    from certvllm.config import CertConfig

    for decode_pass in ("two_pass", "resident"):
        _check_block_budget(CertConfig(promotion_cache_fraction=fraction, cuda_graphs=graphs, decode_pass=decode_pass),
                            fraction, layers, kv_heads, block_size, head_size, itemsize, graphs)  # fmt: skip


def _check_block_budget(cfg, fraction, layers, kv_heads, block_size, head_size, itemsize, graphs,
                        page_bytes=None) -> None:  # fmt: skip
    """``page_bytes``: a pool block's device bytes where it holds more than the certified layers' pages (a hybrid
    model's native layers)."""
    import math

    from certvllm.formats.layout import PageLayout
    from certvllm.vllm_plugin.device_budget import blocks_with_pool

    c = PageLayout(head_size, cfg.value_group_size).bytes_per_token
    page = layers * kv_heads * block_size * c if page_bytes is None else page_bytes
    subs = block_size // 16
    resident = cfg.decode_pass == "resident"

    def used(blocks: int) -> int:
        if fraction == 0:
            return blocks * page
        slots = max(1, math.ceil(fraction * blocks * subs * kv_heads))  # promotion_cache.pool_slots
        key_slot = 16 * head_size * itemsize + 16  # a key page and two tags (also a prefetch ring slot)
        pages = blocks * subs * kv_heads
        if resident:  # ResidentPool: value pages and fill flags, slot_of per page, hand and count
            pool = slots * (key_slot + 16 * head_size * itemsize + 4) + 4 * pages + 16
        else:  # the hashed pool: and two claim entries (promotion_cache.bytes_per_slot)
            pool = slots * (key_slot + 16)
        used = blocks * page + layers * (pool + 8 * blocks * subs)
        if graphs:  # no step prefetch
            return used
        cap = max(1, math.ceil(cfg.prefetch_fraction * pages))  # prefetch.StepPrefetcher.for_cache
        return used + 2 * cap * key_slot + layers * (8 * cap + 4 * pages)  # ring; page lists and grid maps

    for planned in (1, 50, 1000, 123_457):
        kept = blocks_with_pool(planned, layers=layers, kv_heads=kv_heads, block_size=block_size,
                                head_size=head_size, itemsize=itemsize, cfg=cfg, page_bytes=page_bytes)  # fmt: skip
        assert 0 <= kept <= planned
        if fraction == 0:
            assert kept == planned
        if kept:
            assert used(kept) <= planned * page, (planned, kept)
        if planned >= 1000:
            assert used(kept + 2) > planned * page, f"kept {kept} of {planned}: more blocks would fit"


def _runtime(**cert):
    from types import SimpleNamespace

    from certvllm.vllm_plugin.runtime import WorkerRuntime

    vllm_config = SimpleNamespace(
        additional_config={"certvllm": cert}, model_config=SimpleNamespace(served_model_name=["m"]),
        parallel_config=SimpleNamespace(data_parallel_rank=0),
    )  # fmt: skip
    return WorkerRuntime.of(vllm_config)


def test_runtime_binds_each_layer_once_per_kv_tensor():
    """The worker's runtime gives each layer one state per vLLM KV tensor: the same tensor returns the same
    state (the forward looks it up), a new tensor (profiling → the real cache) a new tiered cache with its
    own shadow; on the CPU no promotion pool or step prefetch exists."""
    import torch

    from certvllm.vllm_plugin.host_tier import vllm_page_layout

    rt = _runtime()
    c = vllm_page_layout(64, 16).bytes_per_token
    kv = torch.zeros(6, 2, 16, c, dtype=torch.uint8)
    first = rt.bind("model.layers.3.self_attn.attn", kv, 64, torch.float16)
    assert first.index == 3 and rt.layer("model.layers.3.self_attn.attn") is first
    assert rt.bind("model.layers.3.self_attn.attn", kv, 64, torch.float16) is first
    assert first.residency.pool is None and rt.prefetcher is None  # CPU: none
    assert rt.host_bytes == first.cache.shadow.numel() * 2
    again = rt.bind("model.layers.3.self_attn.attn", torch.zeros(8, 2, 16, c, dtype=torch.uint8), 64, torch.float16)
    assert again is not first and again.cache.num_blocks == 8 and rt.layer(again.name) is again
    with pytest.raises(RuntimeError, match="no certified cache yet"):
        rt.layer("model.layers.4.self_attn.attn")
    with pytest.raises(ValueError, match="does not match the certified page"):
        rt.bind("model.layers.5.self_attn.attn", torch.zeros(6, 2, 16, c + 16, dtype=torch.uint8), 64, torch.float16)


def test_runtime_replays_graphs_only_where_a_graph_can_hold_the_call(monkeypatch):
    """``WorkerRuntime.certified`` takes the layer's CUDA graph (``LayerCallGraphs.run``, keyed by the layer and
    its KV tensor) unless the call has a host-side exact recompute (the CPU path's ``exact_rows``), the layer
    runs the step prefetch (eager only), or the graphs refuse the row count; the other calls go to the op
    directly. Checked with a stand-in for the graphs (the real ones need a GPU:
    tests/attention/test_layer_graphs.py)."""
    import torch

    from certvllm.vllm_plugin import runtime as runtime_module
    from certvllm.vllm_plugin.host_tier import vllm_page_layout

    rt = _runtime()  # the module's one runtime (a second one would register its metrics twice)
    c = vllm_page_layout(64, 16).bytes_per_token
    state = rt.bind("model.layers.9.self_attn.attn", torch.zeros(6, 2, 16, c, dtype=torch.uint8), 64, torch.float16)
    calls: list[str] = []

    class Graphs:
        def handles(self, rows: int) -> bool:
            return rows <= 2

        def run(self, layer, *args, **kwargs):
            calls.append(f"graph {layer[0]} {layer[1] == state.cache.pages.data_ptr()}")
            return "replayed"

    monkeypatch.setattr(rt, "_layer_graphs", lambda device: Graphs())
    monkeypatch.setattr(runtime_module, "certified_attention", lambda *a, **k: calls.append("op") or "direct")
    q, tables, lens = torch.zeros(2, 4, 64), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    assert rt.certified(state, q, tables, lens, 0.125, None) == "replayed"
    assert rt.certified(state, q, tables, lens, 0.125, None, exact_rows=lambda rows: None) == "direct"
    assert rt.certified(state, torch.zeros(3, 4, 64), tables, lens, 0.125, None) == "direct"
    state.residency.prefetcher, state.residency.pool, state.residency.prefetch_index = object(), object(), 0
    assert rt.certified(state, q, tables, lens, 0.125, None) == "direct"
    assert calls == ["graph model.layers.9.self_attn.attn True", "op", "op", "op"]
    rt.layers.pop(state.name)  # leave the shared runtime as the other tests expect it


def test_vllm_page_is_two_bytes_per_head_dim_whatever_the_value_group():
    """vLLM sizes its KV tensor before certvllm's settings are known: the page is 2·D bytes per token and KV
    head for every head size; g = 16 fills it, g = 32 pads it, g = 8 does not fit and is refused."""
    from certvllm.formats.layout import PageLayout
    from certvllm.vllm_plugin.backend import SUPPORTED_HEAD_SIZES
    from certvllm.vllm_plugin.host_tier import check_page_fits, vllm_page_layout

    for d in SUPPORTED_HEAD_SIZES:
        assert vllm_page_layout(d, 16).bytes_per_token == 2 * d == PageLayout(d, 16).bytes_per_token
        if d % 32 == 0:
            check_page_fits(d, 32)
            assert vllm_page_layout(d, 32).page_bytes == 32 * d
        with pytest.raises(ValueError, match="--cert-value-group-size 16 or 32"):
            check_page_fits(d, 8)


def test_key_page_sources_come_from_the_pool_and_the_prefetch_counters():
    """Once per step the runtime exports where promoted keys came from: pool hits, pages served by the step
    prefetch, and the rest (over PCIe), read from each layer's pool counters and the worker's prefetch counters
    (taken once: they count every layer), all joining the step's one read."""
    from types import SimpleNamespace

    import torch

    from certvllm.kv.deferred import DeferredStats, ReadBatch
    from certvllm.kv.residency import Residency

    batches = []

    def taker(values):
        def take(batch):  # the step's counters join its one read
            batches.append(batch)
            return DeferredStats.of(values)

        return take

    pool = SimpleNamespace(take_stats_deferred=taker({"lookups": 100, "hits": 60, "fills": 10, "bypass": 30}))
    prefetch = SimpleNamespace(take_stats_deferred=taker({"staged": 40, "candidates": 40, "served": 25}))
    cache = SimpleNamespace(pages=torch.zeros(1))
    rt = _runtime()
    rt.layers = {
        f"l{i}": SimpleNamespace(residency=r, cache=cache)
        for i, r in enumerate((Residency(pool, prefetch, 3), Residency(pool, prefetch, 4), Residency()))
    }
    step = ReadBatch()
    seen = [c.sources() for c in rt._key_pages(torch.device("cpu"), step)]
    assert seen == [(60, 25, 15), (60, 0, 40)]  # the prefetch's 25 served pages counted once
    assert batches == [step, step, step]


def test_runtime_warms_up_each_head_layout_once_and_logs_it(caplog):
    """The metadata builder's warm-up goes through the runtime: one warm-up per head layout and device, logged
    (on the CPU there is nothing to compile, and the log line says so)."""
    import logging

    import torch

    rt = _runtime()
    with caplog.at_level(logging.INFO, logger="vllm.certvllm"):
        rt.warm_up(8, 2, 64, torch.bfloat16, 4096, 16, 16, torch.device("cpu"))
        rt.warm_up(8, 2, 64, torch.bfloat16, 4096, 16, 16, torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if "warm-up" in r.getMessage()]
    assert len(lines) == 1 and "nothing to compile" in lines[0]
