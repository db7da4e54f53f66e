"""vLLM attention backend for ``--kv-cache-dtype certified``.

KV tensor (per layer, vLLM layout LBHNC): ``[num_blocks, H_kv, B, C]`` uint8 with the vLLM block size
``B = m·16`` (16 on GPUs; 128, vLLM's default, on the CPU) and ``C = 2·D`` bytes per token and KV head
(``host_tier.vllm_page_layout``: 256 at D = 128, half of FP16). ``kv_cache[b, h]`` holds ``m`` tier-1 pages
of 16-token blocks in the byte layout of ``certvllm.formats.layout``; the core addresses them as blocks
``b·m + i``. Each block also has a shadow page per layer in the worker's host tier (``host_tier.py``),
written by :meth:`CertifiedAttentionImpl.do_kv_cache_update` at the same slots.

Per step (``CertifiedMetadataBuilder`` splits the batch):
* decode tokens (one query token per request) → certified attention on the pages;
* prefill tokens with no cached context → exact attention (the step's own keys and values);
* prefill tokens that read cached blocks (chunked prefill, prefix-cache hits) → exact attention, or
  certified per query token with ``prefill: certified``;
* ``mode: dense`` → everything exact.
Never an uncertified output: every token is either certified (with its bound recorded in the
metrics) or exact.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from certvllm.config import CertConfig
from certvllm.formats.layout import BLOCK_SIZE
from certvllm.kv.shadow_copy import ShadowRun, full_block_runs
from certvllm.vllm_plugin import settings
from certvllm.vllm_plugin._compat import KV_CACHE_DTYPE, HostBlockTable, batch_request_ids, lbhnc_layouts
from certvllm.vllm_plugin.exact import ExactAttention, ExactPlan
from certvllm.vllm_plugin.runtime import WorkerRuntime

logger = logging.getLogger("vllm.certvllm")  # under "vllm": shares vLLM's log handlers
SUPPORTED_HEAD_SIZES = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256]


class CertifiedAttentionBackend(AttentionBackend):
    """INT8-key / INT4-value pages with a host shadow tier and per-head certificates."""

    forward_includes_kv_cache_update: bool = False
    # float32: the CPU's activation dtype where it has no native bf16 (certvllm serve picks it, preflight.py)
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = [KV_CACHE_DTYPE]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[CertifiedAttentionImpl]:
        return CertifiedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[CertifiedMetadataBuilder]:
        return CertifiedMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
        # any multiple of 16: a vLLM block then holds several 16-token pages and never gets split
        return [MultipleOf(BLOCK_SIZE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return SUPPORTED_HEAD_SIZES

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[Any, ...]:
        return lbhnc_layouts()

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = KV_CACHE_DTYPE) -> tuple[int, ...]:  # fmt: skip
        """``[num_blocks, H_kv, B, 2·D]`` uint8: one ``B``-token run of certified pages per (block, KV head)
        (what vLLM 0.26 allocates from; 0.32/0.33 use the LBHNC layout and ``customize_spec``, same bytes)."""
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Size vLLM's page to ours: ``2·D`` bytes per token per KV head (``host_tier.vllm_page_layout``)."""
        if spec.state_content_bytes is not None:
            return spec
        return replace(spec, state_content_bytes=2 * spec.head_size)


@dataclass
class CertifiedMetadata:
    """One step's split of the batch (built once per step, shared by every layer).

    Attributes:
        num_actual_tokens: query tokens in the batch (excluding padding).
        row_tokens: ``[R]`` int64 query-token index of each certified row.
        row_block_table: ``[R, W·m]`` the row's request block table in 16-token block ids, cut to the W engine
            blocks the longest row needs.
        row_engine_table: ``[R, max_blocks]`` the same in vLLM block ids (for the exact kernel).
        row_seq_lens: ``[R]`` int64 (CPU) tokens the row attends to (its own included).
        row_tokens_dev, row_seq_lens_dev: ``row_tokens`` and ``row_seq_lens`` on the attention device (copied
            once per step, from pinned memory without waiting, on CUDA; the same tensors on the CPU).
        exact_tokens: ``[E]`` int64 query tokens served exactly (None: none; all tokens when ``exact_all``).
        exact_plan: the exact kernel's plan for those tokens' requests.
        exact_all: every token is exact and ``exact_plan`` is the batch's own plan.
        exact_counts: exact tokens by reason, for the metrics.
        row_slots_dev: ``[R]`` int64 on the attention device, each certified row's request slot in the worker's
            per-request ledger (None when the run returns no certificates: ``certificates.py``).
        exact_requests: ``(request id, reason, tokens)`` of the exact tokens, for the same ledger.
        rows_leading: the certified rows are the batch's first ``R`` query tokens in order (a decode-only step):
            the layers read and write them as slices, without a gather and a scatter.
    """

    num_actual_tokens: int
    row_tokens: torch.Tensor
    row_block_table: torch.Tensor
    row_engine_table: torch.Tensor
    row_seq_lens: torch.Tensor
    row_tokens_dev: torch.Tensor
    row_seq_lens_dev: torch.Tensor
    exact_tokens: torch.Tensor | None
    exact_plan: ExactPlan | None
    exact_all: bool
    exact_counts: dict[str, int] = field(default_factory=dict)
    row_slots_dev: torch.Tensor | None = None
    exact_requests: tuple[tuple[str, str, int], ...] = ()
    rows_leading: bool = False


def exact_reason(query_len: int, context: int, cfg: CertConfig) -> str | None:
    """How a request's query tokens of this step are served: None = certified rows, else the reason they are exact
    (``vllm:cert_exact_tokens_total``'s label). A request with no cached context is a prefill, served exactly, also
    when its prompt is one token long (``query_len == 1``: not a decode step, which always has context)."""
    if cfg.mode == "dense":
        return "dense_mode"
    if context == 0:
        return "prefill"
    if query_len == 1 or cfg.prefill == "certified":
        return None
    return "prefill_cached"


def attention_layer_kinds(vllm_config: VllmConfig) -> dict[str, bool]:
    """Every attention layer of this worker's model, by name: whether it holds certified pages (its KV cache dtype is
    ``certified``) or native ones (vLLM kept it in the model's dtype: a hybrid model's sliding-window layers,
    ``--kv-cache-dtype-skip-layers``)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
    # attention layers only: the other AttentionLayerBase kinds (Mamba, linear attention) have no KV cache dtype
    return {name: layer.kv_cache_dtype == KV_CACHE_DTYPE for name, layer in layers.items()
            if isinstance(getattr(layer, "kv_cache_dtype", None), str)}  # fmt: skip


RUNNER_ATTRIBUTES = ("input_batch", "req_states")  # what either GPU model runner (V1, V2) holds; the CPU one too


def find_model_runner(max_depth: int = 40, holds: tuple[str, ...] = RUNNER_ATTRIBUTES) -> Any:
    """The vLLM model runner that is constructing the caller (None if there is none on the stack).

    vLLM 0.32's attention metadata carries no request ids (``CommonAttentionMetadata.req_idx`` is model runner V2
    only), but the runner that builds it holds the step's batch: request ``i`` of ``build()``'s metadata is
    ``runner.input_batch.req_ids[i]``. The builder is constructed by the runner itself
    (``GPUModelRunner.initialize_attn_backend``, also the CPU runner's), so the runner is the ``self`` of a frame
    above: looked up once, read each step (a list the runner keeps, no copy). ``holds``: attributes of which the
    runner must have one (model runner V2 has ``req_states`` and no ``input_batch``)."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if (owner is not None and type(owner).__name__.endswith("ModelRunner")
                and any(hasattr(owner, name) for name in holds)):  # fmt: skip
            return owner
        frame = frame.f_back
    return None


class CertifiedMetadataBuilder(AttentionMetadataBuilder[CertifiedMetadata]):
    """Splits each step into certified rows and exact tokens (decodes are not reordered).

    Where the run returns per-request certificates (``runtime.ledger``), it also names each row's request: the
    batch's request ``i`` is ``input_batch.req_ids[i]`` of the model runner that builds the metadata, or under model
    runner V2 of the step's ``input_batch`` (vLLM lays the step's tokens out in that order; :func:`find_model_runner`,
    ``_compat.batch_request_ids``).
    """

    _runner: Any = None  # the model runner whose batch this builder describes (None: rows name no request)
    _host_table: HostBlockTable | None = None  # shadow_writes: copy_engine's view of the runner's block table

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:  # fmt: skip
        if type(self) is not CertifiedMetadataBuilder:  # vLLM wraps the builder of chunked-local / static-sink layers
            raise ValueError(
                f"--kv-cache-dtype certified cannot serve layers {', '.join(layer_names)}: {type(self).__name__} "
                "rewrites their batches (chunked local attention or static sinks), which the certified path does not "
                "support; serve this model with --kv-cache-dtype auto."
            )
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config: CertConfig = settings.cert_config(vllm_config)
        self.runtime = WorkerRuntime.of(vllm_config)
        self.runtime.note_layers(attention_layer_kinds(vllm_config))  # vllm:cert_layer_certified
        self._host_lens_exact = getattr(vllm_config, "speculative_config", None) is None
        model = vllm_config.model_config
        num_heads = model.get_num_attention_heads(vllm_config.parallel_config)
        # plans only: the softmax scale is applied by each layer's impl
        self.exact = ExactAttention(num_heads, kv_cache_spec.num_kv_heads, kv_cache_spec.head_size, model.dtype,
                                    1.0, kv_cache_spec.block_size, device.type == "cpu",
                                    self.config.dense_backend)  # fmt: skip
        if self.runtime.ledger is not None:  # either GPU model runner (V2 keeps req_states, not input_batch)
            self._runner = find_model_runner()
        # shadow_writes: copy_engine reads the step's block table rows on the host (_compat.HostBlockTable)
        self._layer_names = list(layer_names)
        if self.config.shadow_writes == "copy_engine" and device.type == "cuda":
            runner = find_model_runner()
            if runner is None:
                logger.warning("certvllm: shadow_writes=copy_engine needs vLLM's GPU model runner (the block table's "
                               "rows on the host) and none builds this metadata; layers %s keep the SM stores",
                               ", ".join(layer_names))  # fmt: skip
            else:
                self._host_table = HostBlockTable(runner)
        if self.runtime.ledger is not None and self._runner is None:
            # rows would name no request: every certificate would read 0, a false one
            raise RuntimeError(
                "certvllm: per-request certificates need the model runner that builds the batch (vLLM's "
                "GPUModelRunner or CPUModelRunner), and none constructs this metadata builder; start without "
                "--cert-return-certificate"
            )
        # before the engine reports ready: no request may wait on a kernel compile
        self.runtime.warm_up(num_heads, kv_cache_spec.num_kv_heads, kv_cache_spec.head_size, model.dtype,
                             model.max_model_len, vllm_config.scheduler_config.max_num_seqs,
                             kv_cache_spec.block_size, device)  # fmt: skip

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CertifiedMetadata:  # fmt: skip
        cm = common_attn_metadata
        self.runtime.begin_step()  # the batch is scheduled: start staging the first layers' pages
        qsl = cm.query_start_loc_cpu.to(torch.int64)
        n_req = cm.num_reqs
        qsl = qsl[: n_req + 1]
        seq_lens = self._host_seq_lens(cm, n_req)
        q_lens = qsl[1:] - qsl[:-1]
        context = seq_lens - q_lens
        cfg = self.config
        block_table = cm.block_table_tensor[:n_req]

        exact_req: list[int] = []
        counts = {"prefill": 0, "prefill_cached": 0, "dense_mode": 0}
        row_tok: list[torch.Tensor] = []
        row_req: list[torch.Tensor] = []
        row_len: list[torch.Tensor] = []
        for i in range(n_req):
            ql, ctx, start = int(q_lens[i]), int(context[i]), int(qsl[i])
            if ql == 0:
                continue
            reason = exact_reason(ql, ctx, cfg)
            if reason is None:
                row_tok.append(torch.arange(start, start + ql))
                row_req.append(torch.full((ql,), i))
                row_len.append(torch.arange(ctx + 1, ctx + ql + 1))
            else:
                exact_req.append(i)
                counts[reason] += ql
        cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)  # noqa: E731
        rows_req = self._to_device(cat(row_req))
        exact_all = len(exact_req) == n_req and n_req > 0
        exact_tokens, plan = None, None
        if exact_all:
            plan = self.exact.plan(qsl.to(torch.int32), seq_lens, block_table)
            exact_tokens = torch.arange(int(qsl[-1]))
        elif exact_req:
            idx = torch.tensor(exact_req)
            sub_q = q_lens[idx]
            sub_qsl = torch.cat((torch.zeros(1, dtype=torch.int64), sub_q.cumsum(0)))
            plan = self.exact.plan(sub_qsl, seq_lens[idx], block_table[self._to_device(idx)])
            exact_tokens = torch.cat([torch.arange(int(qsl[i]), int(qsl[i + 1])) for i in exact_req])
        if self._host_table is not None:  # every step: a step without runs must not reuse the last one's
            self.runtime.set_shadow_runs(self._layer_names, self._shadow_runs(cm, n_req, qsl, q_lens, context))
        slots_dev, exact_requests = self._requests(n_req, q_lens, context, cat(row_req))
        sub = self.kv_cache_spec.block_size // BLOCK_SIZE
        row_lens = cat(row_len)
        # only the columns the longest row uses: vLLM's table is max_model_len wide, and the certified
        # kernels' work (split plan, selection, reductions) scales with the table width, not the lengths
        width = max(1, -(-int(row_lens.max()) // self.kv_cache_spec.block_size)) if row_lens.numel() else 1
        row_table = block_table[rows_req, :width].to(torch.int64)
        if sub > 1:  # vLLM block ids → 16-token block ids
            row_table = (row_table.unsqueeze(-1) * sub + torch.arange(sub, device=row_table.device)).flatten(1)
        row_tokens = cat(row_tok)
        return CertifiedMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            row_tokens=row_tokens,
            row_block_table=row_table,
            row_engine_table=block_table[rows_req],
            row_seq_lens=row_lens,
            row_tokens_dev=self._to_device(row_tokens),
            row_seq_lens_dev=self._to_device(row_lens),
            exact_tokens=exact_tokens,
            exact_plan=plan,
            exact_all=exact_all,
            exact_counts=counts,
            row_slots_dev=slots_dev,
            exact_requests=exact_requests,
            # ascending token indices: tokens 0..R-1 exactly when the last one is R-1
            rows_leading=bool(row_tokens.numel()) and int(row_tokens[-1]) == row_tokens.numel() - 1,
        )

    def _requests(self, n_req: int, q_lens: torch.Tensor, context: torch.Tensor,
                  rows_req: torch.Tensor) -> tuple[torch.Tensor | None, tuple[tuple[str, str, int], ...]]:  # fmt: skip
        """The per-request ledger's view of the step (``runtime.ledger``; None and () without one): each certified
        row's slot on the device, and each exact request's tokens by reason. Sets ``runtime.step_requests``."""
        ledger = getattr(self.runtime, "ledger", None)
        if ledger is None:
            return None, ()
        names = (batch_request_ids(self._runner) or []) if self._runner is not None else []
        # padded requests of a graphed batch (and dummy runs) are past the runner's batch: they name no request
        ids: list[str | None] = [names[i] if i < len(names) else None for i in range(n_req)]
        self.runtime.step_requests = [r for r in ids if r is not None]
        exact = []
        for i, rid in enumerate(ids):
            ql = int(q_lens[i])
            reason = exact_reason(ql, int(context[i]), self.config) if ql else None
            if reason is not None and rid is not None:
                exact.append((rid, reason, ql))
        slots = ledger.slots([ids[i] for i in rows_req.tolist()], self.device)
        return self._to_device(slots), tuple(exact)

    def _shadow_runs(self, cm: CommonAttentionMetadata, n_req: int, qsl: torch.Tensor, q_lens: torch.Tensor,
                     context: torch.Tensor) -> tuple[ShadowRun, ...]:  # fmt: skip
        """The engine blocks this step's write fills completely, as runs of consecutive block ids in the step's
        token order (``shadow_copy.full_block_runs`` per request of at least one block's tokens); () where the
        block table's rows are not known on the host (``HostBlockTable.rows``), and no run for a request whose row
        is not (−1)."""
        size = self.kv_cache_spec.block_size
        long = torch.nonzero(q_lens[:n_req] >= size).flatten().tolist()  # every step: no per-request loop
        if not long or self._host_table is None:
            return ()
        host = self._host_table.rows(cm.block_table_tensor, n_req)
        if host is None:
            if not self._host_table.reported:
                self._host_table.reported = True
                logger.warning("certvllm: shadow_writes=copy_engine: this runner's block table rows are not known on "
                               "the host; layers %s keep the SM stores", ", ".join(self._layer_names))  # fmt: skip
            return ()
        runs: list[ShadowRun] = []
        for i in long:
            ctx, ql = int(context[i]), int(q_lens[i])
            ids = np.asarray(host[i, : (ctx + ql) // size])
            if ids.shape[0] and int(ids.min()) < 0:
                continue
            runs += full_block_runs(int(qsl[i]), ctx, ql, ids, size)
        if runs and not self._host_table.reported:
            self._host_table.reported = True
            logger.info("certvllm: shadow_writes=copy_engine: the first prefill blocks go to the host tier by the "
                        "copy engines (%d blocks in %d runs)", sum(r.blocks for r in runs), len(runs))  # fmt: skip
        return tuple(runs)

    def _host_seq_lens(self, cm: CommonAttentionMetadata, n_req: int) -> torch.Tensor:
        """``[n_req]`` int64 lengths on the host: vLLM's CPU copy where it is exact (its upper bound is the length
        unless speculative decoding runs), else one read of the device's (a synchronisation per step)."""
        bound = getattr(cm, "seq_lens_cpu_upper_bound", None)
        if bound is not None and self._host_lens_exact:
            return bound[:n_req].to(torch.int64)
        return cm.seq_lens[:n_req].to("cpu", torch.int64)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A step's host index tensor on the attention device: from pinned memory without waiting on CUDA (a
        blocking copy would wait for the stream), itself on the CPU."""
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)


class CertifiedAttentionImpl(AttentionImpl[CertifiedMetadata]):
    """Write path (pages + shadow) and the certified / exact forward."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = KV_CACHE_DTYPE, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **kwargs: Any) -> None:  # fmt: skip
        unsupported = {
            "ALiBi slopes": alibi_slopes is not None,
            "a sliding window": sliding_window is not None,
            "logit soft-capping": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            "cross-layer KV sharing": kv_sharing_target_layer_name is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        bad = [name for name, present in unsupported.items() if present]
        if bad:
            raise ValueError(
                f"--kv-cache-dtype certified does not support {', '.join(bad)}; serve this model with "
                "--kv-cache-dtype auto."
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        vllm_config = get_current_vllm_config()
        self.config = settings.cert_config(vllm_config)
        self.runtime = WorkerRuntime.of(vllm_config)
        self.dtype = vllm_config.model_config.dtype
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self._exact: ExactAttention | None = None

    # -- write path --------------------------------------------------------------------------------
    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:  # fmt: skip
        """Store new tokens: originals into the shadow, full blocks quantized into their pages. The first write
        to a KV tensor binds the layer's certified state to it (``WorkerRuntime.bind``)."""
        state = self.runtime.bind(layer.layer_name, kv_cache, self.head_size, self.dtype)
        cache = state.cache
        n = slot_mapping.shape[0]
        if cache.keys_channel_major:
            # the CPU shadow is vLLM's own CPU cache layout: write it with vLLM's kernel, exactly as
            # --kv-cache-dtype auto writes its cache, then quantize the blocks this write completed
            from vllm import _custom_ops as ops

            e, h, _, block, d = cache.shadow.shape
            key_cache, value_cache = cache.shadow.view(e, h, 2 * block, d).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping,
                                           self._exact_runtime(kv_cache).isa)  # fmt: skip
            cache.encode_completed(slot_mapping)
        elif cache.pages.device.type == "cuda":  # device stores into the shadow, completed blocks encoded there
            self.runtime.write_on_device(state, key[:n], value[:n], slot_mapping)  # no host synchronisation
        else:
            cache.write(key[:n], value[:n], slot_mapping)

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: CertifiedMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the certified backend")
        if attn_metadata is None:  # profiling / warm-up
            return output
        meta = attn_metadata
        state = self.runtime.layer(layer.layer_name)
        cache = state.cache
        if cache.pages.data_ptr() != kv_cache.data_ptr():
            raise RuntimeError(f"certvllm: layer {state.name} runs on a KV tensor its write path never bound")
        q = query.view(-1, self.num_heads, self.head_size)
        out = output.view(-1, self.num_heads, self.head_size)
        exact = self._exact_runtime(kv_cache)
        pagein = self.runtime.pagein(kv_cache.device)
        metrics = self.runtime.metrics

        if meta.row_tokens.numel():
            # no host synchronisation from here to the end of the certified rows on CUDA: the step's index
            # tensors went up once, from pinned memory, when the builder made them; the reports are summed on the
            # device and go down once per step, from pinned memory, read by the metrics' flusher thread
            R = meta.row_tokens.numel()
            rows_q = q[:R] if meta.rows_leading else q[meta.row_tokens_dev]
            # CPU: rungs 3/4 run vLLM's own CPU kernel on the shadow (token-identical to `auto`); CUDA: the op
            # recomputes them on the device, inside the layer call (a CUDA graph's replay where the runtime has one)
            exact_rows = self._exact_rows(exact, meta, rows_q, cache, pagein) if exact.on_cpu else None
            res = self.runtime.certified(state, rows_q, meta.row_block_table, meta.row_seq_lens_dev, self.scale,
                                         self.generator, exact_rows, slots=meta.row_slots_dev, step=meta)  # fmt: skip
            if meta.rows_leading:
                out[:R].copy_(res.out)
            else:
                out[meta.row_tokens_dev] = res.out.to(out.dtype)
            self.runtime.record_call(state, res.report, pagein)  # CUDA: tallied on the device, read per step

        if meta.exact_plan is not None:
            # this step's keys and values (already in the shadow): a prefill on CUDA reads only its cached
            # context over PCIe
            k_new = key.view(-1, self.num_kv_heads, self.head_size)
            v_new = value.view(-1, self.num_kv_heads, self.head_size)
            pool = state.residency.pool
            direct = pool.direct_keys() if pool is not None else None  # cached keys in VRAM: only values over PCIe
            with pagein.uncounted():  # exact traffic is not exported; the step's certified counts are kept
                if meta.exact_all:
                    n = meta.num_actual_tokens
                    exact.run(meta.exact_plan, q[:n], cache, out[:n], pagein, fresh=(k_new[:n], v_new[:n]),
                              direct=direct)  # fmt: skip
                else:
                    idx = meta.exact_tokens.to(q.device)
                    part = torch.empty(idx.numel(), self.num_heads, self.head_size, dtype=out.dtype,
                                       device=out.device)  # fmt: skip
                    exact.run(meta.exact_plan, q[idx].contiguous(), cache, part, pagein,
                              fresh=(k_new[idx], v_new[idx]), direct=direct)  # fmt: skip
                    out[idx] = part
            if state.index == self.runtime.counting_layer:  # once per step: the model's first certified layer
                for reason, count in meta.exact_counts.items():
                    metrics.count_exact_tokens(reason, count)
                if self.runtime.ledger is not None:
                    for request, reason, count in meta.exact_requests:
                        self.runtime.ledger.record_exact(request, reason, count)
        return output

    def _exact_rows(self, exact: ExactAttention, meta: CertifiedMetadata, rows_q: torch.Tensor, cache: Any,
                    pagein: Any) -> Any:  # fmt: skip
        """Rungs 3/4 for listed certified rows with vLLM's exact kernel on the shadow."""

        def dense_rows(rows: list[int]) -> torch.Tensor:
            idx = torch.tensor(rows, dtype=torch.int64)
            plan = exact.plan(torch.arange(len(rows) + 1), meta.row_seq_lens[idx],
                              meta.row_engine_table[idx.to(rows_q.device)])  # fmt: skip
            dense = torch.empty(len(rows), self.num_heads, self.head_size, dtype=self.dtype, device=rows_q.device)
            exact.run(plan, rows_q[idx.to(rows_q.device)].contiguous(), cache, dense, pagein)
            return dense.float()

        return dense_rows

    def _exact_runtime(self, kv_cache: torch.Tensor) -> ExactAttention:
        if self._exact is None:
            self._exact = ExactAttention(self.num_heads, self.num_kv_heads, self.head_size, self.dtype, self.scale,
                                         kv_cache.shape[2], kv_cache.device.type == "cpu",
                                         self.config.dense_backend)  # fmt: skip
        return self._exact
