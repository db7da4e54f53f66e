"""The CPU shadow tier is written by vLLM's own CPU kernel (``ops.cpu_attn_reshape_and_cache``, the plugin's write
path) with the kernel variant ``exact.shadow_isa`` picks, and read by certvllm as transposed keys and plain values
(``LayerKVCache(keys_channel_major=True)``). The originals read back must be exactly the ones written, for every
dtype, block size and head size the plugin serves on this CPU: vLLM's AMX variant (bfloat16 at block sizes that are
multiples of 32, on CPUs with AMX tiles) stores another layout, so ``shadow_isa`` never returns it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from certvllm.vllm_plugin.exact import shadow_isa  # noqa: E402
from certvllm.vllm_plugin.host_tier import layer_cache, vllm_page_layout  # noqa: E402

HKV, BLOCKS = 2, 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_shadow_reads_back_what_vllms_cpu_kernel_wrote(dtype, block_size, head_dim):
    from vllm import _custom_ops as ops

    isa = shadow_isa(dtype, block_size, head_dim)
    assert isa != "amx"
    layout = vllm_page_layout(head_dim, 16)
    kv = torch.zeros(BLOCKS, HKV, block_size, layout.bytes_per_token, dtype=torch.uint8)
    cache = layer_cache("layers.0.attn", kv, head_dim, dtype, 16)
    gen = torch.Generator().manual_seed(block_size + head_dim)
    slots = torch.randperm(BLOCKS * block_size, generator=gen)[: block_size + 5]  # scattered, two blocks at least
    key = torch.randn(slots.numel(), HKV, head_dim, generator=gen).to(dtype)
    value = torch.randn(slots.numel(), HKV, head_dim, generator=gen).to(dtype)
    # the plugin's write path (backend.CertifiedAttentionImpl.do_kv_cache_update, CPU branch)
    e, h, _, block, d = cache.shadow.shape
    key_cache, value_cache = cache.shadow.view(e, h, 2 * block, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    sub = block_size // 16  # 16-token pages per vLLM block
    page = slots // 16  # certvllm's block id of each slot
    for head in range(HKV):
        got = cache.shadow_pages(page, torch.full_like(page, head))  # [n, 2, 16, D]
        at = torch.arange(slots.numel())
        assert torch.equal(got[at, 0, slots % 16], key[:, head]), (isa, head)
        assert torch.equal(got[at, 1, slots % 16], value[:, head]), (isa, head)
    assert cache.sub_blocks == sub
