"""The metadata builder's side of ``shadow_writes: copy_engine``: the host copy of the step's block table taken from
vLLM's model runner (``_compat.host_block_table``), and the runs of whole engine blocks it hands the write path
(``CertifiedMetadataBuilder._shadow_runs``), checked on stand-in runner objects shaped as vLLM 0.26's GPU model
runner keeps them (``input_batch.block_table.block_tables[g].block_table.{cpu,gpu}``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from certvllm.kv.shadow_copy import ShadowRun
from certvllm.vllm_plugin._compat import host_block_table
from certvllm.vllm_plugin.backend import CertifiedMetadataBuilder


def _runner(*tables: tuple[torch.Tensor, torch.Tensor]) -> SimpleNamespace:
    groups = [SimpleNamespace(block_table=SimpleNamespace(cpu=cpu, gpu=gpu)) for cpu, gpu in tables]
    return SimpleNamespace(input_batch=SimpleNamespace(block_table=SimpleNamespace(block_tables=groups)))


def test_host_block_table_is_the_group_whose_device_table_the_metadata_views():
    cpu0, gpu0 = torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, 8, dtype=torch.int32)
    cpu1, gpu1 = torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32)
    runner = _runner((cpu0, gpu0), (cpu1, gpu1))
    assert host_block_table(runner, gpu1[:3]) is cpu1  # the metadata holds the first num_reqs rows
    assert host_block_table(runner, gpu0[:2]) is cpu0
    assert host_block_table(runner, torch.zeros(4, 8, dtype=torch.int32)) is None  # no group's tensor
    assert host_block_table(SimpleNamespace(), gpu0) is None  # a runner without the tables (another vLLM)
    assert host_block_table(None, gpu0) is None


def test_shadow_runs_cover_the_whole_blocks_of_the_steps_long_requests():
    # request 0: a decode token; request 1: a chunk at context 20 of 50 tokens over blocks [4, 9, 10, 11];
    # request 2: a prompt of 40 tokens from 0 over [2, 3, 7]
    table = torch.tensor([[6, 0, 0, 0], [4, 9, 10, 11], [2, 3, 7, 0]], dtype=torch.int32)
    device_table = table.clone()
    builder = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16), _runner=_runner((table, device_table)))
    q_lens = torch.tensor([1, 50, 40])
    context = torch.tensor([30, 20, 0])
    qsl = torch.tensor([0, 1, 51, 91])
    cm = SimpleNamespace(block_table_tensor=device_table)
    runs = CertifiedMetadataBuilder._shadow_runs(builder, cm, 3, qsl, q_lens, context)
    # request 1: positions 20 … 69, whole blocks 2 and 3 (ids 10, 11) from its token 32 − 20 = 12 (step token 13)
    # request 2: positions 0 … 39, whole blocks 0 and 1 (ids 2, 3) from step token 51
    assert runs == (ShadowRun(13, 10, 2), ShadowRun(51, 2, 2))
    decode_only = CertifiedMetadataBuilder._shadow_runs(builder, cm, 1, qsl[:2], q_lens[:1], context[:1])
    assert decode_only == ()  # no request of a block's tokens: nothing to copy
    elsewhere = SimpleNamespace(block_table_tensor=torch.zeros(3, 4, dtype=torch.int32))
    assert CertifiedMetadataBuilder._shadow_runs(builder, elsewhere, 3, qsl, q_lens, context) == ()
