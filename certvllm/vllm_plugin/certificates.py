"""Per-request certificates, carried from the workers to the API server by a KV connector.

vLLM 0.32 returns per-request data computed in the workers to the client in one place: a KV connector's
``kv_transfer_params``. The scheduler-side connector's ``request_finished`` returns them when a request finishes;
vLLM puts them on the request's final output (``EngineCoreOutput`` → ``RequestOutput.kv_transfer_params``) and the
OpenAI server writes them into the non-streaming response. The worker-side connector reports to the scheduler-side
one every step through ``build_connector_worker_meta`` (``KVConnectorOutput.kv_connector_worker_meta``, aggregated
over the tensor and pipeline parallel ranks by vLLM's ``KVOutputAggregator``). :class:`CertvllmConnector` uses
exactly these hooks and transfers no KV: it never matches external tokens, loads, saves or delays a block free.
No other vLLM mechanism returns per-request worker data to the server (the routed-experts auxiliary output is MoE
specific; stat loggers and Prometheus are aggregates), so a connector is the least invasive one that works without
patching vLLM. The plugin registers it in vLLM's ``KVConnectorFactory`` as ``CertvllmConnector``; the config
``certvllm serve --cert-return-certificate`` writes names its module path too
(``settings.certificate_transfer_config``).

Flow of one request:

1. *Scheduler:* ``on_new_request`` decides whether the request wants its certificate (``always`` mode, or its
   ``kv_transfer_params`` hold ``"certvllm": true``) and announces it to the workers in the next step's connector
   metadata.
2. *Workers:* every certified layer call adds its report to the rows' requests on the device
   (``certvllm.metrics.requests.RequestLedger``, fed by the backend: nothing is read in the layer call). Once a
   step's forward is launched, :meth:`CertvllmConnector.build_connector_worker_meta` snapshots the totals of the
   wanted requests of that step: a non-blocking copy behind a CUDA event. It is read only when the scheduler side
   consumes it (or when it is pickled to leave a worker process), which vLLM does after it has waited for the
   step's sampled tokens: by then the copy has landed and reading it waits for nothing.
3. *Scheduler:* ``request_finished`` (the request's last step) returns ``{"certvllm": {...}}`` as its
   ``kv_transfer_params``; the same ``update_from_output`` call then hands the scheduler that step's worker
   metadata (``update_connector_output``, called after the requests' outputs are made), which completes the
   returned object *in place* with the last step's totals before vLLM serializes the outputs. The certificate
   therefore covers every step of the request, its last one included.
4. *API server:* ``certificate_api.CertificateMiddleware`` moves the object to the response's top-level
   ``certvllm`` field, in non-streaming responses and in the final chunk of a stream (vLLM's streaming responses
   drop ``kv_transfer_params``).

Samples of one request (``n`` > 1: vLLM's child requests ``"{i}_{parent}"``) are merged: each child's object covers
the children finished so far, so the last one (the one vLLM returns) covers all of them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from certvllm.metrics.requests import LedgerSnapshot, RequestTotals, certificate, merge_certificates
from certvllm.vllm_plugin import settings
from certvllm.vllm_plugin.runtime import WorkerRuntime

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput

logger = logging.getLogger("vllm.certvllm")  # under "vllm": shares vLLM's log handlers
CERTIFICATE_KEY = "certvllm"
"""The key of the certificate in ``kv_transfer_params`` (request: the switch; response: the object)."""
_CHILD = re.compile(r"(\d+)_(.+)")  # vLLM's child requests of n > 1: f"{index}_{parent request id}"


def wants_certificate(kv_transfer_params: Any) -> bool:
    """Whether a request's ``kv_transfer_params`` ask for its certificate (``{"certvllm": true}``)."""
    if not isinstance(kv_transfer_params, dict):
        return False
    value = kv_transfer_params.get(CERTIFICATE_KEY)
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return value is True or (isinstance(value, int) and value == 1)


class CertificateConnectorMetadata(KVConnectorMetadata):
    """Scheduler → workers, each step: the requests that want their certificate, announced once."""

    def __init__(self, wanted: Iterable[str] = ()) -> None:
        self.wanted = tuple(wanted)


class CertificateWorkerMeta(KVConnectorWorkerMetadata):
    """Workers → scheduler, each step: the totals of the step's wanted requests, read lazily.

    Holds a :class:`LedgerSnapshot` until :meth:`totals` is called, or until it is pickled to leave its worker
    process (multiprocess executors), which happens after the step's own synchronisation; then plain values."""

    def __init__(self, snapshot: LedgerSnapshot | None = None,
                 totals: dict[str, RequestTotals] | None = None) -> None:  # fmt: skip
        self._snapshot = snapshot
        self._totals = totals

    def totals(self) -> dict[str, RequestTotals]:
        if self._totals is None:
            self._totals = self._snapshot.totals() if self._snapshot is not None else {}
            self._snapshot = None
        return self._totals

    def aggregate(self, other: KVConnectorWorkerMetadata) -> CertificateWorkerMeta:
        """The totals over two workers of one engine (``RequestTotals.merge_ranks``)."""
        merged = dict(self.totals())
        if isinstance(other, CertificateWorkerMeta):
            for rid, totals in other.totals().items():
                merged[rid] = merged[rid].merge_ranks(totals) if rid in merged else totals
        return CertificateWorkerMeta(totals=merged)

    def __getstate__(self) -> dict[str, Any]:
        return {"_snapshot": None, "_totals": self.totals()}


class CertvllmConnector(KVConnectorBase_V1, SupportsHMA):
    """The KV connector of per-request certificates (see the module docstring). Transfers no KV."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.mode = settings.certificate_mode(vllm_config) or "request"
        # scheduler side
        self._wanted: set[str] = set()  # requests whose certificate is returned, until they finish
        self._announce: list[str] = []  # wanted requests the workers have not been told of yet
        self._group: dict[str, str] = {}  # wanted request → its group (the parent of n > 1 samples, else itself)
        self._members: dict[str, set[str]] = {}  # group → its wanted requests
        self._latest: dict[str, RequestTotals] = {}  # the last totals the workers reported, per wanted request
        self._done: dict[str, dict[str, RequestTotals]] = {}  # group → its finished requests' totals
        self._finishing: dict[str, str] = {}  # finished requests whose last step's totals are awaited → group
        self._pending: list[tuple[str, dict[str, Any]]] = []  # (group, kv_transfer_params) returned, to complete
        # worker side
        self._worker_wanted: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # nothing is handed off: a preempted request is recomputed as without a connector

    # -- worker side -------------------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, CertificateConnectorMetadata):
            self._worker_wanted.update(connector_metadata.wanted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests leave the ledger (their last step's totals were snapshotted in that step)."""
        if finished_req_ids:
            runtime = WorkerRuntime.current()
            if runtime is not None and runtime.ledger is not None:
                runtime.ledger.release(finished_req_ids)
            self._worker_wanted.difference_update(finished_req_ids)
        return None, None

    def build_connector_worker_meta(self) -> CertificateWorkerMeta | None:
        """The step's wanted requests' totals (a snapshot taken in stream order after the step's layer calls)."""
        runtime = WorkerRuntime.current()
        if runtime is None or runtime.ledger is None or not runtime.step_requests:
            return None
        step, runtime.step_requests = runtime.step_requests, []
        ids = step if self.mode == "always" else [r for r in step if r in self._worker_wanted]
        return CertificateWorkerMeta(runtime.ledger.snapshot(ids)) if ids else None

    # -- scheduler side ----------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def on_new_request(self, request: Any) -> None:
        if self.mode != "always" and not wants_certificate(getattr(request, "kv_transfer_params", None)):
            return
        rid = request.request_id
        child = _CHILD.fullmatch(rid)
        group = child.group(2) if child else rid
        self._wanted.add(rid)
        self._announce.append(rid)
        self._group[rid] = group
        self._members.setdefault(group, set()).add(rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CertificateConnectorMetadata:
        announce, self._announce = self._announce, []
        return CertificateConnectorMetadata(announce)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        return self._finished(request)

    def _finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """The request's ``kv_transfer_params``: its certificate as known now, completed by this step's worker
        metadata in :meth:`update_connector_output` (the same ``update_from_output`` call, before vLLM serializes
        the outputs). The blocks are freed at once."""
        rid = request.request_id
        if rid not in self._wanted:
            return False, None
        group = self._group.get(rid, rid)
        self._done.setdefault(group, {})[rid] = self._latest.get(rid, RequestTotals())
        self._finishing[rid] = group
        params: dict[str, Any] = {CERTIFICATE_KEY: self._certificate(group)}
        self._pending.append((group, params))
        return False, params

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, CertificateWorkerMeta):
            for rid, totals in meta.totals().items():
                if rid in self._finishing:
                    self._done[self._finishing[rid]][rid] = totals
                elif rid in self._wanted:
                    self._latest[rid] = totals
        for group, params in self._pending:  # the objects already on this step's outputs: completed in place
            params[CERTIFICATE_KEY] = self._certificate(group)
        self._pending.clear()
        for rid, group in self._finishing.items():
            self._wanted.discard(rid)
            self._latest.pop(rid, None)
            self._group.pop(rid, None)
            if self._members.get(group, set()) <= set(self._done.get(group, {})):
                self._members.pop(group, None)
                self._done.pop(group, None)
        self._finishing.clear()

    def _certificate(self, group: str) -> dict[str, Any]:
        return merge_certificates(certificate(t) for t in self._done[group].values()) or certificate(RequestTotals())

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # the certified backend's own layout (LBHNC) is kept
