"""A hybrid-attention model at 8B-class shapes on a CUDA GPU with ``--kv-cache-dtype certified`` (``pytest -m gpu``;
written for vLLM 0.26 on an H200): OLMo 3 7B's architecture (32 layers, 3 sliding-window layers of 4096 tokens to
1 full-attention layer, 32 query and 32 KV heads of 128; ``certvllm.models.SHAPES["olmo-3-7b"]``) with dummy weights.

The model folder is ``--hybrid8b-dir``, else ``.device/olmo3-7b-dummy``, written when missing from the prepared
SmolLM2 folder's tokenizer (``--smollm2-dir``; build it here with ``python -m certvllm.models dummy
.device/olmo3-7b-dummy --shape olmo-3-7b`` and carry it, as ``.device/llama8b-dummy``). One engine through
``certvllm.vllm_plugin.harness``: vLLM's default compilation and CUDA graphs, ``max_model_len`` 16384, the default
preset, a host tier of HOST_GB, a 2048-token prefill budget. Phases: ``batch`` (16 concurrent 1024-token prompts, 32
tokens each) and ``long`` (two 12000-token prompts, 16 tokens: chunked prefill, and contexts three times the window,
so the sliding layers drop blocks while the certified ones keep them all).

Checks: the engine starts and serves every request; the 8 full-attention layers are certified and the 24 sliding
ones native (``vllm:cert_layer_certified`` and the startup log); every query token is accounted for on the certified
layers only (``test_gpu_vllm.check_accounting`` with 8 layers); the ladder as on the 8B Llama (flat dummy attention:
no rung-3 bound on the long phase); the host tier holds ``blocks x shadow pages per pool block x B_c x 32 x 2 x 128 x
2`` bytes, with the certified block ``B_c`` and the shadow pages per pool block read from the startup log (vLLM 0.26
pads the native page and sizes ``B_c`` itself), within the budget and below the figure of a model whose 32 layers
are all certified; no block held after a phase. The capacity figures (pool blocks, device bytes, vLLM's token
capacity, certified tokens, host bytes) are printed (``-s``) for the record.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_gpu_vllm import (
    GPU_ENGINE,
    _req,
    _smollm2_dir,
    check_accounting,
    check_ladder,
    check_nothing_held,
    counter,
    gauge,
    run_spec,
    token_ids,
    tokens,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's CUDA build (pytest -m gpu)"),
]

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / ".device" / "olmo3-7b-dummy"
SHAPE = "olmo-3-7b"
HOST_GB = 16.0
"""The host tier: 4096 pool blocks of 4 MiB of shadow (8 shadow pages of 32-token certified blocks, the 0.26 H200
alignment). One 16384-token request takes about 2050 of them: 512 in the full-attention group, and in each of the
three sliding groups the window plus the tokens in flight (two batches of 2048), which vLLM reserves for every group."""
BATCHED_TOKENS = 2048
LAYERS, HEADS, KV_HEADS, HEAD_DIM, ITEMSIZE = 32, 32, 32, 128, 2
FULL = list(range(3, LAYERS, 4))  # OLMo 3: every fourth layer has full attention
BATCH, BATCH_PROMPT, LONG_PROMPT = 16, 1024, 12000
HYBRID_LOG = re.compile(
    r"certvllm: hybrid KV cache: certified layers ([\d, ]+); native layers ([\d, ]+); (\d+) KV cache groups; "
    r"(\d+)-token certified blocks; (\d+) shadow pages? per pool block; (\d+) pool blocks x ([\d.]+) KiB on the device"
)


@pytest.fixture(scope="module")
def hybrid8b(request: pytest.FixtureRequest) -> Path:
    option = request.config.getoption("--hybrid8b-dir")
    folder = Path(option) if option else DEFAULT_DIR
    if not (folder / "config.json").is_file():
        from certvllm.models import ModelPreparationError, write_shaped_dummy

        try:
            write_shaped_dummy(folder, SHAPE, tokenizer_dir=_smollm2_dir(request.config))
        except ModelPreparationError as exc:
            pytest.fail(f"no dummy model at {folder} and none can be written: {exc}. Build it where the bundled "
                        f"model is prepared (`python -m certvllm.models dummy {folder} --shape {SHAPE}`) and carry "
                        "the folder, or pass --hybrid8b-dir DIR")  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def engine(hybrid8b: Path) -> dict[str, Any]:
    phases = {
        "batch": {"requests": [_req(token_ids(BATCH_PROMPT, 6000 + i), 32) for i in range(BATCH)]},
        "long": {"requests": [_req(token_ids(LONG_PROMPT, 7000 + i), 16) for i in range(2)]},
    }
    spec = dict(kv_cache_dtype="certified", cert={"host_memory_gb": HOST_GB},
                engine={**GPU_ENGINE, "load_format": "dummy", "max_model_len": 16384, "max_num_seqs": 32,
                        "max_num_batched_tokens": BATCHED_TOKENS},
                phases=phases)  # fmt: skip
    return run_spec("hybrid8b", hybrid8b, spec)


def _layout(result: dict[str, Any]) -> dict[str, Any]:
    """The startup log's hybrid KV cache line and host tier line, parsed."""
    line = HYBRID_LOG.search(result["log"])
    assert line, "no 'certvllm: hybrid KV cache:' line in the engine's log"
    host = re.search(r"host tier shadows (\d+) blocks = ([\d.]+) GiB", result["log"])
    assert host, "no 'host tier shadows' line in the engine's log"
    numbers = [int(x) for x in line.group(1).split(", ")]
    return {"certified": numbers, "native": [int(x) for x in line.group(2).split(", ")], "groups": int(line.group(3)),
            "block": int(line.group(4)), "slots": int(line.group(5)), "blocks": int(line.group(6)),
            "device_kib": float(line.group(7)), "host_blocks": int(host.group(1)), "line": line.group(0)}  # fmt: skip


def test_hybrid8b_serves_with_sliding_layers_native(engine, hybrid8b):
    assert [len(t) for t in tokens(engine["phases"]["batch"])] == [32] * BATCH
    assert [len(t) for t in tokens(engine["phases"]["long"])] == [16] * 2
    layout = _layout(engine)
    print(f"\n{layout['line']}")
    assert layout["certified"] == FULL
    assert layout["native"] == [i for i in range(LAYERS) if i not in FULL]
    phase = engine["phases"]["long"]
    got = {i: gauge(phase, "vllm:cert_layer_certified", layer=str(i)) for i in range(LAYERS)}
    assert got == {i: float(i in FULL) for i in range(LAYERS)}


def test_hybrid8b_accounts_for_every_token_on_the_certified_layers(engine):
    batch, long = engine["phases"]["batch"], engine["phases"]["long"]
    check_accounting(batch, len(FULL), HEADS)
    check_accounting(long, len(FULL), HEADS)
    check_ladder(batch)  # 1056-token contexts: every key block fits the default preset's FP16 set
    check_ladder(long, max_head_fallback_share=None)  # flat dummy attention past 2K tokens: rung 3 (test_gpu_vllm)
    assert counter(long, "vllm:cert_exact_tokens_total", reason="prefill_cached") > 0  # chunked prefill
    for phase in (batch, long):
        check_nothing_held(phase)


def test_hybrid8b_capacity_host_tier_holds_the_certified_layers_only(engine):
    layout = _layout(engine)
    blocks, block, slots = layout["blocks"], layout["block"], layout["slots"]
    assert layout["host_blocks"] == blocks and block % 16 == 0
    assert slots == len(FULL)  # vLLM groups layers by the rarer kind's count: the 8 full layers form one group
    per_block = slots * block * KV_HEADS * 2 * HEAD_DIM * ITEMSIZE
    host = gauge(engine["phases"]["long"], "vllm:cert_host_tier_bytes")
    device = blocks * layout["device_kib"] * 1024
    print(f"\nhybrid 8B capacity: {blocks} pool blocks x {layout['device_kib']:.0f} KiB = {device / 2**30:.2f} GiB on "
          f"the device ({layout['groups']} KV cache groups, {block}-token certified blocks: up to {blocks * block} "
          f"certified tokens); vLLM's KV cache size {engine['kv_cache_tokens']} tokens; host tier {host:.0f} bytes = "
          f"{host / 2**30:.2f} GiB ({per_block} per block, budget {HOST_GB} GiB)")  # fmt: skip
    assert host == blocks * per_block <= HOST_GB * 2**30
    assert per_block < LAYERS * block * KV_HEADS * 2 * HEAD_DIM * ITEMSIZE  # every layer certified
