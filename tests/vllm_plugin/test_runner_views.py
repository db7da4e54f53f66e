"""What the metadata builder reads of the model runner that builds it, for both of vLLM 0.26's GPU runners, checked on
stand-in objects shaped as vLLM keeps them: the step's block table rows on the host (``_compat.HostBlockTable``) and
the runs of whole engine blocks the builder hands the write path (``CertifiedMetadataBuilder._shadow_runs``,
``shadow_writes: copy_engine``), and the batch's request ids (``_compat.batch_request_ids``, per-request
certificates). The V1 runner keeps host/device table pairs (``input_batch.block_table.block_tables[g].block_table.
{cpu,gpu}``) and ``input_batch.req_ids``; model runner V2 keeps device-only tables written through
``block_tables.append_block_ids``, gathered by the step's ``input_batch.idx_mapping_np``, and the step's
``input_batch.req_ids`` (with made-up ids in its dummy batches)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from certvllm.kv.shadow_copy import ShadowRun
from certvllm.vllm_plugin._compat import HostBlockTable, batch_request_ids
from certvllm.vllm_plugin.backend import CertifiedMetadataBuilder, find_model_runner


def _v1_runner(*tables: tuple[torch.Tensor, torch.Tensor]) -> SimpleNamespace:
    groups = [SimpleNamespace(block_table=SimpleNamespace(cpu=cpu, gpu=gpu)) for cpu, gpu in tables]
    return SimpleNamespace(input_batch=SimpleNamespace(block_table=SimpleNamespace(block_tables=groups)))


class _V2BlockTables:
    """The parts of vLLM 0.26's ``gpu/block_table.BlockTables`` the mirror reads (one group, 2 kernel blocks per
    KV block in group 1 when ``per`` is 2)."""

    def __init__(self, slots: int, width: int, per: tuple[int, ...] = (1,)) -> None:
        self.blocks_per_kv_block = list(per)
        self.block_tables = [SimpleNamespace(gpu=torch.zeros(slots, width, dtype=torch.int32)) for _ in per]
        self.input_block_tables = [torch.zeros(slots, width, dtype=torch.int32) for _ in per]
        self.num_blocks = SimpleNamespace(np=np.zeros((len(per), slots), dtype=np.int32))
        self.device_rows = [np.zeros((slots, width), dtype=np.int64) for _ in per]  # what the device table holds

    def append_block_ids(self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        for g, ids in enumerate(new_block_ids):
            start = 0 if overwrite else int(self.num_blocks.np[g, req_index])
            per = self.blocks_per_kv_block[g]
            ids = [b * per + k for b in ids for k in range(per)]
            self.device_rows[g][req_index, start : start + len(ids)] = ids
            self.num_blocks.np[g, req_index] = start + len(ids)


class GPUModelRunner:  # the name find_model_runner looks for; V2 keeps req_states, not input_batch
    def __init__(self, tables: _V2BlockTables) -> None:
        self.req_states = SimpleNamespace(req_id_to_index={"a": 0, "b": 3})
        self.block_tables = tables

    def build_request_ids(self, req_ids: list[str]) -> list[str | None] | None:
        input_batch = SimpleNamespace(req_ids=req_ids)  # noqa: F841 - read from this frame
        return batch_request_ids(self)

    def build_step(self, host: HostBlockTable, group: int, idx_mapping: list[int]):
        input_batch = SimpleNamespace(idx_mapping_np=np.array(idx_mapping, dtype=np.int32))  # noqa: F841 - read
        return host.rows(self.block_tables.input_block_tables[group][: len(idx_mapping)], len(idx_mapping))


def test_v1_rows_are_the_group_whose_device_table_the_metadata_views():
    cpu0, gpu0 = torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, 8, dtype=torch.int32)
    cpu1, gpu1 = torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32)
    host = HostBlockTable(_v1_runner((cpu0, gpu0), (cpu1, gpu1)))
    assert torch.equal(host.rows(gpu1[:3], 3), cpu1[:3])  # the metadata holds the first num_reqs rows
    assert torch.equal(host.rows(gpu0[:2], 2), cpu0[:2])
    assert host.rows(torch.zeros(4, 8, dtype=torch.int32), 2) is None  # no group's tensor
    assert HostBlockTable(SimpleNamespace()).rows(gpu0, 2) is None  # a runner without the tables (another vLLM)


def test_v2_rows_mirror_the_runners_block_id_writes_in_the_batchs_order():
    tables = _V2BlockTables(slots=4, width=6, per=(1, 2))
    runner = GPUModelRunner(tables)
    tables.append_block_ids(0, ([1, 2], [3]), overwrite=True)  # before the mirror: slot 0 stays unknown
    host = HostBlockTable(runner)
    assert (runner.build_step(host, 0, [1, 2]) == -1).all()  # the first build attaches the mirror
    tables.append_block_ids(2, ([7, 8], [4]), overwrite=True)
    tables.append_block_ids(2, ([9], [5]), overwrite=False)
    tables.append_block_ids(1, ([4], [0]), overwrite=True)
    tables.append_block_ids(0, ([5], [6]), overwrite=False)  # appended to a row the mirror never saw
    rows = runner.build_step(host, 0, [2, 1, 0])
    np.testing.assert_array_equal(rows[0, :3], tables.device_rows[0][2, :3])
    np.testing.assert_array_equal(rows[1, :1], [4])
    assert (rows[2] == -1).all()  # still unknown: no runs for it
    rows1 = runner.build_step(host, 1, [2])  # group 1: two kernel blocks per KV block
    np.testing.assert_array_equal(rows1[0, :4], [8, 9, 10, 11])
    tables.append_block_ids(0, ([6], [1]), overwrite=True)  # a new request takes slot 0: known from now on
    np.testing.assert_array_equal(runner.build_step(host, 0, [0])[0, :2], [6, -1])
    assert host.rows(torch.zeros(4, 6, dtype=torch.int32), 1) is None  # not one of the runner's tables


def test_find_model_runner_finds_either_gpu_runner():
    class Owner(GPUModelRunner):
        def construct(self) -> tuple[object, object]:
            return find_model_runner(), find_model_runner(holds=("input_batch",))

    owner = Owner(_V2BlockTables(1, 1))
    Owner.__name__ = "GPUModelRunner"
    assert owner.construct() == (owner, None)  # V2 holds req_states, no input_batch


def test_shadow_runs_cover_the_whole_blocks_of_the_steps_long_requests():
    # request 0: a decode token; request 1: a chunk at context 20 of 50 tokens over blocks [4, 9, 10, 11];
    # request 2: a prompt of 40 tokens from 0 over [2, 3, 7]; request 3: a prompt whose row is unknown (−1)
    table = torch.tensor([[6, 0, 0, 0], [4, 9, 10, 11], [2, 3, 7, 0], [-1, -1, -1, -1]], dtype=torch.int32)
    device_table = table.clone()
    builder = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16),
                              _host_table=HostBlockTable(_v1_runner((table, device_table))))  # fmt: skip
    q_lens = torch.tensor([1, 50, 40, 32])
    context = torch.tensor([30, 20, 0, 0])
    qsl = torch.tensor([0, 1, 51, 91, 123])
    cm = SimpleNamespace(block_table_tensor=device_table)
    runs = CertifiedMetadataBuilder._shadow_runs(builder, cm, 4, qsl, q_lens, context)
    # request 1: positions 20 … 69, whole blocks 2 and 3 (ids 10, 11) from its token 32 − 20 = 12 (step token 13)
    # request 2: positions 0 … 39, whole blocks 0 and 1 (ids 2, 3) from step token 51
    assert runs == (ShadowRun(13, 10, 2), ShadowRun(51, 2, 2))
    decode_only = CertifiedMetadataBuilder._shadow_runs(builder, cm, 1, qsl[:2], q_lens[:1], context[:1])
    assert decode_only == ()  # no request of a block's tokens: nothing to copy
    elsewhere = SimpleNamespace(block_table_tensor=torch.zeros(4, 4, dtype=torch.int32))
    assert CertifiedMetadataBuilder._shadow_runs(builder, elsewhere, 4, qsl, q_lens, context) == ()


def test_batch_request_ids_of_either_runner():
    v1 = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["x", "y"]))
    assert batch_request_ids(v1) == ["x", "y"]
    v2 = GPUModelRunner(_V2BlockTables(1, 1))
    assert v2.build_request_ids(["b", "a"]) == ["b", "a"]
    assert v2.build_request_ids(["a", "req_1_dummy"]) == ["a", None]  # a dummy batch's made-up id names no request
    assert batch_request_ids(v2) is None  # no input_batch up the stack
    assert batch_request_ids(SimpleNamespace()) is None
