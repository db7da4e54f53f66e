"""Per-request certificates (issue 20 part 1): the ``certvllm`` object of completion and chat responses.

Without a server: the connector's two sides (a request that asks is announced to the workers, the worker side
snapshots its totals every step, the scheduler side returns them at the end of the request and completes them in
place with the last step's totals, samples of one request merge, ``always`` mode, finished requests leave the
ledger), the API server's middleware (JSON bodies and the last chunk of a stream) and its observer of the engine
client (closing it closes the engine's generator), the model runner lookup of the metadata builder, and the
``--cert-return-certificate`` flag.

Through the real server (the session's shared ``certvllm serve``, tests/conftest.py ``certified_server``, started
with ``--cert-return-certificate request``): a request that asks gets its certificate and one that does not gets
none; the numbers of a request run alone equal the Prometheus deltas it caused (head-steps by rung, promoted
blocks, audits, exact prefill tokens; its largest relative bound lies in the top occupied bucket of
``vllm:cert_bound_relative``); the last chunk of a stream (completion and chat) carries it; two concurrent requests
get their own numbers, which add up to the pair's deltas; the prompts and samples of one completion share one
object.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from certvllm.bounds.report import CertReport
from certvllm.metrics.requests import RequestLedger, RequestTotals
from certvllm.vllm_plugin import certificate_api, settings
from certvllm.vllm_plugin.certificate_api import CertificateBook, CertificateMiddleware, observe

LAYERS, HEADS = 30, 9  # the bundled SmolLM2-135M


# -- the connector, without an engine ------------------------------------------------------------------------------
def _connector(role: str, mode: str = "request") -> Any:
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from certvllm.vllm_plugin.certificates import CertvllmConnector

    kv = SimpleNamespace(kv_connector=settings.CONNECTOR_NAME, kv_connector_extra_config={"certificates": mode})
    return CertvllmConnector(SimpleNamespace(kv_transfer_config=kv), getattr(KVConnectorRole, role), None)


def _request(rid: str, asks: bool) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, kv_transfer_params={"certvllm": True} if asks else None)


def _report(rows: int, rung: int, bound: float = 0.01) -> CertReport:
    r = CertReport.zeros(rows, HEADS)
    r.rung.fill_(rung)
    r.e_key.fill_(bound if rung <= 2 else 0.0)
    r.v_max.fill_(2.0)
    r.k_star.fill_(1)
    return r


class _Worker:
    """A worker's runtime as the connector sees it (``WorkerRuntime.current()``): a ledger and the step's batch."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from certvllm.vllm_plugin.runtime import WorkerRuntime

        self.runtime = SimpleNamespace(ledger=RequestLedger(), step_requests=[])
        monkeypatch.setattr(WorkerRuntime, "_current", self.runtime)

    def step(self, rows: list[str], rung: int = 0, bound: float = 0.01) -> None:
        """One step: each row a decode of its request, every layer at ``rung``."""
        slots = self.runtime.ledger.slots(rows, "cpu")
        for _ in range(LAYERS):
            self.runtime.ledger.record(_report(len(rows), rung, bound), slots)
        self.runtime.step_requests = list(dict.fromkeys(rows))


def test_the_certificate_covers_the_last_step_and_is_completed_in_place(monkeypatch):
    scheduler, worker_side = _connector("SCHEDULER"), _connector("WORKER")
    worker = _Worker(monkeypatch)
    scheduler.on_new_request(_request("asks", True))
    scheduler.on_new_request(_request("quiet", False))
    meta = scheduler.build_connector_meta(None)
    assert meta.wanted == ("asks",) and scheduler.build_connector_meta(None).wanted == ()  # announced once
    worker_side.bind_connector_metadata(meta)
    outputs = []
    for step in range(3):
        worker.step(["quiet", "asks"], rung=2 if step == 2 else 0, bound=0.01 * (step + 1))
        out = worker_side.build_connector_worker_meta()
        assert set(out.totals()) == {"asks"}  # only the request that asked travels
        outputs.append(SimpleNamespace(kv_connector_worker_meta=out))
    scheduler.update_connector_output(outputs[0])
    scheduler.update_connector_output(outputs[1])
    # the last step: vLLM finishes the request first, then hands the scheduler that step's worker output
    done, params = scheduler.request_finished(_request("asks", True), [])
    assert done is False and params["certvllm"]["head_steps"]["0"] == 2 * LAYERS * HEADS  # known so far
    assert scheduler.request_finished(_request("quiet", False), []) == (False, None)
    scheduler.update_connector_output(outputs[2])
    cert = params["certvllm"]  # the same dict, completed in place before vLLM serializes the output
    assert cert["head_steps"] == {"0": 2 * LAYERS * HEADS, "1": 0, "2": LAYERS * HEADS, "3": 0, "4": 0}
    assert cert["bound_max"] == pytest.approx(0.03) and cert["bound_relative_max"] == pytest.approx(0.015)
    assert cert["promoted_key_blocks"] == 3 * LAYERS * HEADS and cert["requests"] == 1
    # the scheduler forgets the request; the worker side releases it when vLLM reports it finished
    assert not scheduler._wanted and not scheduler._latest and not scheduler._done
    worker_side.get_finished({"asks", "quiet"})
    assert worker.runtime.ledger.requests == 0 and not worker_side._worker_wanted


def test_worker_metadata_pickles_to_values_and_aggregates_over_ranks(monkeypatch):
    worker_side = _connector("WORKER", mode="always")
    worker = _Worker(monkeypatch)
    worker.step(["r"], rung=3)
    one = worker_side.build_connector_worker_meta()
    worker.step(["r"], rung=0)  # after the snapshot: not in it
    moved = pickle.loads(pickle.dumps(one))  # what leaves a worker process (multiprocess executors)
    assert moved._snapshot is None and moved.totals()["r"].counts[3] == LAYERS * HEADS
    other = type(one)(totals={"r": RequestTotals([1, 0, 0, 0, 0, 0, 0, 0, 0, 0], [0.5, 0.1], [0, 0, 0])})
    both = moved.aggregate(other).totals()["r"]
    assert both.counts[0] == 1 and both.counts[3] == LAYERS * HEADS and both.maxes == [0.5, 0.1]


def test_always_mode_and_samples_of_one_request(monkeypatch):
    scheduler = _connector("SCHEDULER", mode="always")
    for i in range(2):  # vLLM's two samples of one request with n=2
        scheduler.on_new_request(_request(f"{i}_cmpl-x-0-abcd1234", False))
    assert len(scheduler.build_connector_meta(None).wanted) == 2

    def meta(rid: str, rung0: int) -> SimpleNamespace:
        totals = RequestTotals([rung0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [0.1, 0.01], [4, 0, 0])
        from certvllm.vllm_plugin.certificates import CertificateWorkerMeta

        return SimpleNamespace(kv_connector_worker_meta=CertificateWorkerMeta(totals={rid: totals}))

    _, first = scheduler.request_finished(_request("0_cmpl-x-0-abcd1234", False), [])
    scheduler.update_connector_output(meta("0_cmpl-x-0-abcd1234", 10))
    assert first["certvllm"]["requests"] == 1 and first["certvllm"]["head_steps"]["0"] == 10
    _, last = scheduler.request_finished(_request("1_cmpl-x-0-abcd1234", False), [])
    scheduler.update_connector_output(meta("1_cmpl-x-0-abcd1234", 7))
    # the sample that finishes last (whose params vLLM returns for the request) covers both
    assert last["certvllm"]["requests"] == 2 and last["certvllm"]["head_steps"]["0"] == 17
    assert last["certvllm"]["exact_tokens"]["prefill"] == 8 and not scheduler._members


def test_the_connector_transfers_no_kv_and_keeps_the_certified_layout():
    connector = _connector("SCHEDULER")
    assert connector.get_num_new_matched_tokens(_request("r", True), 0) == (0, False)
    assert not connector.requires_kv_delivery
    assert type(connector).get_required_kvcache_layout(None) is None
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import certvllm.vllm_plugin as plugin

    plugin.register()
    assert KVConnectorFactory.get_connector_class_by_name(settings.CONNECTOR_NAME) is type(connector)


def test_the_runtime_adds_each_call_and_its_audits_to_the_rows_requests(gen):
    """``WorkerRuntime.certified`` with request slots, every head-step audited: each request's totals are its rows'
    rungs, and its audits are its own head-steps (the audit's device-side hook), as the series count them."""
    pytest.importorskip("vllm")
    from prometheus_client import CollectorRegistry

    from certvllm.config import load_config
    from certvllm.metrics import CertMetrics
    from certvllm.metrics.requests import COUNTS
    from certvllm.testing import make_case, paged_batch
    from certvllm.vllm_plugin.runtime import LayerState, WorkerRuntime

    h_q, h_kv, d = 8, 2, 64
    runtime = WorkerRuntime(load_config("default", audit_rate=1.0), "cert", "0")
    registry = CollectorRegistry()
    runtime.metrics = CertMetrics("cert", "0", registry=registry, flush_seconds=3600)
    runtime.ledger = RequestLedger()
    cases = [make_case("sink_and_recency", t, h_q, h_kv, d, torch.bfloat16, gen) for t in (300, 70, 150)]
    cache, tables, lens = paged_batch(cases)
    state = LayerState("model.layers.0.self_attn.attn", 0, cache)
    q = torch.stack([c.q for c in cases]).to(torch.bfloat16)
    slots = runtime.ledger.slots(["a", "b", "a"], "cpu")  # rows 0 and 2 are one request's (a certified prefill)
    res = runtime.certified(state, q, tables, lens, 1 / d**0.5, None, slots=slots)
    runtime.metrics.flush()
    snapshot = runtime.ledger.snapshot(["a", "b"]).totals()
    totals = {r: dict(zip(COUNTS, t.counts, strict=True)) for r, t in snapshot.items()}
    for rid, rows in (("a", [0, 2]), ("b", [1])):
        rungs = res.report.rung[rows].long().flatten()
        for k in range(5):
            assert totals[rid][f"rung_{k}"] == int((rungs == k).sum()), (rid, k)
        assert totals[rid]["audits"] == len(rows) * h_q and totals[rid]["audit_violations"] == 0
    audited = sum(s.value for f in registry.collect() for s in f.samples if s.name == "vllm:cert_audits_total")
    assert audited == 3 * h_q


# -- the API server side -------------------------------------------------------------------------------------------
CERT = {"head_steps": {"0": 5, "1": 0, "2": 1, "3": 0, "4": 0}, "certified_head_steps": 6, "bound_max": 0.5,
        "bound_relative_max": 0.01, "heads_recomputed": 0, "layers_recomputed": 0, "promoted_key_blocks": 1,
        "promoted_value_blocks": 0, "exact_tokens": {"prefill": 3, "prefill_cached": 0, "dense_mode": 0},
        "audits": 0, "audit_violations": 0, "audit_flagged": False, "bound_finite": True, "requests": 1}  # fmt: skip


def _serve(app: Any, path: str = "/v1/completions", method: str = "POST") -> tuple[dict, bytes]:
    """One request through ``CertificateMiddleware(app)``: the response start message and the whole body."""
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "root_path": "",
             "app": SimpleNamespace(state=SimpleNamespace(engine_client=None))}  # fmt: skip
    asyncio.run(CertificateMiddleware(app, BOOK)(scope, receive, send))
    return sent[0], b"".join(m.get("body", b"") for m in sent[1:])


BOOK = CertificateBook()


def _json_app(body: dict) -> Any:
    async def app(scope: dict, receive: Any, send: Any) -> None:
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})

    return app


def _sse_app(events: list[str]) -> Any:
    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})  # fmt: skip
        for event in events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def test_a_json_response_gets_its_certificate_and_the_right_length():
    BOOK.put("cmpl-1-0", CERT)
    BOOK.put("cmpl-1-1", CERT)  # a second prompt of the same completion
    BOOK.put("cmpl-10-0", CERT)  # another response whose id starts the same
    body = {"id": "cmpl-1", "choices": [{"text": "x"}], "kv_transfer_params": {"certvllm": CERT}}
    start, raw = _serve(_json_app(body))
    out = json.loads(raw)
    assert out["certvllm"]["requests"] == 2 and out["certvllm"]["head_steps"]["0"] == 10
    assert out["kv_transfer_params"] is None  # the object moved to the top level
    assert dict(start["headers"])[b"content-length"] == str(len(raw)).encode()
    assert BOOK.take("cmpl-10") is not None and BOOK.take("cmpl-1") is None  # taken once, the other left alone
    # no certificate noted: the one vLLM wrote in kv_transfer_params is used; other keys stay there
    body = {"id": "cmpl-2", "kv_transfer_params": {"certvllm": CERT, "other": 1}}
    out = json.loads(_serve(_json_app(body))[1])
    assert out["certvllm"] == CERT and out["kv_transfer_params"] == {"other": 1}
    plain = {"id": "cmpl-3", "kv_transfer_params": None}
    assert json.loads(_serve(_json_app(plain))[1]) == plain
    assert json.loads(_serve(_json_app(plain), path="/v1/models")[1]) == plain  # other routes untouched


def test_the_last_chunk_of_a_stream_carries_the_certificate():
    BOOK.put("chatcmpl-s", CERT)
    chunk = lambda choices, **kw: "data: " + json.dumps({"id": "chatcmpl-s", "choices": choices, **kw}) + "\n\n"  # noqa: E731
    events = [chunk([{"delta": {"content": "a"}, "finish_reason": None}]), ": keep-alive\n\n",
              chunk([{"delta": {"content": "b"}, "finish_reason": "stop"}]),
              chunk([], usage={"completion_tokens": 2}), "data: [DONE]\n\n"]  # fmt: skip
    _, raw = _serve(_sse_app(events), path="/v1/chat/completions")
    parts = raw.decode().split("\n\n")
    data = [json.loads(p[6:]) for p in parts if p.startswith("data: {")]
    assert [("certvllm" in d) for d in data] == [False, False, True]  # only the usage chunk, the last one
    assert data[-1]["certvllm"] == CERT and parts[-2] == "data: [DONE]" and ": keep-alive" in parts
    # without a usage chunk the finishing chunk is the last one
    BOOK.put("chatcmpl-s", CERT)
    _, raw = _serve(_sse_app([events[0], events[2], events[4]]), path="/v1/chat/completions")
    data = [json.loads(p[6:]) for p in raw.decode().split("\n\n") if p.startswith("data: {")]
    assert "certvllm" not in data[0] and data[1]["certvllm"] == CERT


def test_the_observer_notes_final_certificates_and_closes_the_engine_generator():
    closed = threading.Event()

    class Client:
        async def generate(self, prompt: Any, params: Any, request_id: str, **kw: Any):
            try:
                yield SimpleNamespace(kv_transfer_params=None, finished=False)
                yield SimpleNamespace(kv_transfer_params={"certvllm": CERT}, finished=True)
            finally:
                closed.set()

    book, client = CertificateBook(), Client()
    observe(client, book)
    observe(client, book)  # once per client

    async def consume(stop_early: bool) -> None:
        gen = client.generate("p", None, "cmpl-9-0")
        async for _ in gen:
            if stop_early:
                await gen.aclose()  # what vLLM does when the client goes away
                return

    asyncio.run(consume(stop_early=True))
    assert closed.is_set() and book.take("cmpl-9") is None
    closed.clear()
    asyncio.run(consume(stop_early=False))
    assert closed.is_set() and book.take("cmpl-9") == CERT


def test_the_book_forgets_what_no_response_takes():
    book = CertificateBook(limit=2, ttl_s=60)
    for i in range(3):
        book.put(f"cmpl-{i}-0", CERT)
    assert book.take("cmpl-0") is None and book.take("cmpl-2") == CERT
    book = CertificateBook(ttl_s=0.0)
    book.put("cmpl-a-0", CERT)
    time.sleep(0.01)
    book.put("cmpl-b-0", CERT)
    assert book.take("cmpl-a") is None


# -- the metadata builder's request ids and the command line -------------------------------------------------------
def test_the_builder_finds_the_model_runner_that_constructs_it():
    pytest.importorskip("vllm")
    from certvllm.vllm_plugin.backend import find_model_runner

    class FakeModelRunner:
        input_batch = SimpleNamespace(req_ids=["a", "b"])

        def build(self) -> Any:
            return find_model_runner()

    assert find_model_runner() is None
    runner = FakeModelRunner()
    assert runner.build() is runner


@pytest.mark.parametrize(
    ("flag", "mode"),
    [(["--cert-return-certificate"], "always"), (["--cert-return-certificate", "request"], "request"),
     (["--cert-return-certificate=always"], "always"), (["--cert-return-certificate", "off"], None), ([], None)],
)  # fmt: skip
def test_the_server_flag_adds_the_connector_and_the_middleware(flag, mode):
    from certvllm.cli import build_serve_args

    args, _ = build_serve_args(["m", *flag, "--port", "9"])
    if mode is None:
        assert "--kv-transfer-config" not in args and "--middleware" not in args
        return
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config == settings.certificate_transfer_config(mode)
    assert config["kv_connector_extra_config"] == {"certificates": mode}
    assert args[args.index("--middleware") + 1] == settings.CERTIFICATE_MIDDLEWARE
    assert args[:3] == ["m", "--port", "9"]
    assert f"{certificate_api.__name__}.{CertificateMiddleware.__name__}" == settings.CERTIFICATE_MIDDLEWARE


@pytest.mark.parametrize(
    ("argv", "needle"),
    [(["m", "--cert-return-certificate", "sometimes"], "takes one of request, always, off"),
     (["m", "--cert-return-certificate", "--kv-cache-dtype", "auto"], "needs --kv-cache-dtype certified"),
     (["m", "--cert-return-certificate", "--kv-transfer-config", "{}"], "MultiConnector")],
)  # fmt: skip
def test_bad_uses_of_the_flag_are_refused_naming_the_fix(argv, needle):
    from certvllm.cli import UsageError, build_serve_args

    with pytest.raises(UsageError, match=needle):
        build_serve_args(argv)


# -- through the real server ---------------------------------------------------------------------------------------
def _post(base: str, route: str, body: dict) -> dict:
    from servers import http_post

    return http_post(base + route, body)


def _settled(base: str) -> dict[str, float]:
    """``/metrics`` once two scrapes agree on every certvllm counter (the workers fold their reports every 0.25 s)."""
    from servers import scrape

    previous = scrape(base)
    for _ in range(20):
        time.sleep(0.5)
        current = scrape(base)
        if {k: v for k, v in current.items() if k.startswith("vllm:cert_")} == {
            k: v for k, v in previous.items() if k.startswith("vllm:cert_")
        }:
            return current
        previous = current
    return previous


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _assert_equals_deltas(cert: dict, before: dict[str, float], after: dict[str, float]) -> None:
    """The certificate of the only request between two scrapes equals what that request added to every series."""
    for r in range(5):
        assert cert["head_steps"][str(r)] == _delta(after, before, f'vllm:cert_head_steps_total{{rung="{r}"}}'), r
    assert cert["promoted_key_blocks"] == _delta(after, before, "vllm:cert_promoted_key_blocks_total")
    assert cert["promoted_value_blocks"] == _delta(after, before, "vllm:cert_promoted_value_blocks_total")
    assert cert["certified_head_steps"] == _delta(after, before, "vllm:cert_bound_relative_count")
    for reason in ("prefill", "prefill_cached", "dense_mode"):
        key = f'vllm:cert_exact_tokens_total{{reason="{reason}"}}'
        assert cert["exact_tokens"][reason] == _delta(after, before, key), reason
    audits = sum(_delta(after, before, f'vllm:cert_audits_total{{rung="{r}"}}') for r in range(5))
    violations = sum(_delta(after, before, f'vllm:cert_audit_violations_total{{rung="{r}"}}') for r in range(5))
    assert (cert["audits"], cert["audit_violations"]) == (audits, violations)
    assert cert["audit_flagged"] == (violations > 0)
    # the largest relative bound lies in the highest occupied bucket of the histogram's delta
    edges = ["0.0001", "0.001", "0.003", "0.01", "0.02", "0.05", "0.1", "0.2", "0.5", "1.0", "2.0", "+Inf"]
    counts = [_delta(after, before, f'vllm:cert_bound_relative_bucket{{le="{e}"}}') for e in edges]
    top = next(i for i, c in enumerate(counts) if c == cert["certified_head_steps"])
    largest = cert["bound_relative_max"]
    assert largest <= float(edges[top]) and (top == 0 or largest > float(edges[top - 1]))


def _stream(base: str, route: str, body: dict) -> list[dict]:
    req = urllib.request.Request(base + route, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    events = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


@pytest.mark.vllm
@pytest.mark.slow
def test_a_request_alone_gets_the_numbers_it_added_to_the_metrics(certified_server):
    from servers import SERVED_NAME

    base = certified_server
    plain = _post(base, "/v1/completions", {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 3,
                                            "temperature": 0})  # fmt: skip
    assert "certvllm" not in plain and plain["kv_transfer_params"] is None  # did not ask: nothing

    body = {"model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "kv_transfer_params": {"certvllm": True}}  # fmt: skip
    before = _settled(base)
    out = _post(base, "/v1/completions", body)
    after = _settled(base)
    cert, usage = out["certvllm"], out["usage"]
    assert out["kv_transfer_params"] is None and cert["requests"] == 1
    # every decode step of every layer and query head, the last one included
    assert sum(cert["head_steps"].values()) == (usage["completion_tokens"] - 1) * LAYERS * HEADS
    assert cert["exact_tokens"]["prefill"] == usage["prompt_tokens"]
    assert cert["heads_recomputed"] == cert["head_steps"]["3"]
    assert cert["layers_recomputed"] * HEADS == cert["head_steps"]["4"]
    assert cert["certified_head_steps"] > 0 and 0 < cert["bound_relative_max"] <= 0.001  # --cert-bound-tol 0.001
    assert cert["bound_max"] > 0 and cert["bound_finite"]
    _assert_equals_deltas(cert, before, after)

    # a chat completion, alone, too
    chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12,
            "temperature": 0, "kv_transfer_params": {"certvllm": True}}  # fmt: skip
    before = _settled(base)
    out = _post(base, "/v1/chat/completions", chat)
    _assert_equals_deltas(out["certvllm"], before, _settled(base))
    assert sum(out["certvllm"]["head_steps"].values()) == (out["usage"]["completion_tokens"] - 1) * LAYERS * HEADS


@pytest.mark.vllm
@pytest.mark.slow
def test_a_stream_ends_with_its_certificate(certified_server):
    from servers import SERVED_NAME

    base = certified_server
    completion = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
                  "ignore_eos": True, "kv_transfer_params": {"certvllm": True}}  # fmt: skip
    chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True, "kv_transfer_params": {"certvllm": True},
            "stream_options": {"include_usage": True}}  # fmt: skip
    for route, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        before = _settled(base)
        events = _stream(base, route, body)
        after = _settled(base)
        assert all("certvllm" not in e for e in events[:-1]), route
        cert = events[-1]["certvllm"]
        assert sum(cert["head_steps"].values()) == (10 - 1) * LAYERS * HEADS, route
        _assert_equals_deltas(cert, before, after)
    assert "usage" in events[-1]  # with include_usage the usage chunk is the last one and carries it


@pytest.mark.vllm
@pytest.mark.slow
def test_prompts_and_samples_of_one_response_share_one_certificate(certified_server):
    """Two prompts with ``n`` = 2 samples each: four engine requests, one ``certvllm`` object over all of them."""
    from servers import SERVED_NAME

    base = certified_server
    body = {"model": SERVED_NAME, "prompt": ["The capital of France is", "Water boils at"], "max_tokens": 6, "n": 2,
            "temperature": 0.8, "seed": 3, "ignore_eos": True, "kv_transfer_params": {"certvllm": True}}  # fmt: skip
    before = _settled(base)
    out = _post(base, "/v1/completions", body)
    after = _settled(base)
    cert = out["certvllm"]
    assert len(out["choices"]) == 4 and cert["requests"] == 4
    assert sum(cert["head_steps"].values()) == 4 * (6 - 1) * LAYERS * HEADS
    _assert_equals_deltas(cert, before, after)


@pytest.mark.vllm
@pytest.mark.slow
def test_two_concurrent_requests_get_their_own_numbers(certified_server):
    from servers import SERVED_NAME

    base = certified_server
    asks = {"temperature": 0, "ignore_eos": True, "kv_transfer_params": {"certvllm": True}}
    prompts = (("The capital of France is", 8), ("List the planets of the solar system:", 24))
    bodies = [{"model": SERVED_NAME, "prompt": prompt, "max_tokens": n, **asks} for prompt, n in prompts]
    results: list[dict | None] = [None, None]

    def run(i: int) -> None:
        results[i] = _post(base, "/v1/completions", bodies[i])

    before = _settled(base)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    after = _settled(base)
    certs = [r["certvllm"] for r in results]
    for r, cert in zip(results, certs, strict=True):
        assert sum(cert["head_steps"].values()) == (r["usage"]["completion_tokens"] - 1) * LAYERS * HEADS
        assert cert["exact_tokens"]["prefill"] == r["usage"]["prompt_tokens"]
    assert sum(certs[0]["head_steps"].values()) == 7 * LAYERS * HEADS
    assert sum(certs[1]["head_steps"].values()) == 23 * LAYERS * HEADS
    # their own numbers add up to what the pair added to every series
    for r in range(5):
        key = f'vllm:cert_head_steps_total{{rung="{r}"}}'
        assert certs[0]["head_steps"][str(r)] + certs[1]["head_steps"][str(r)] == _delta(after, before, key)
    for name, series in (("promoted_key_blocks", "vllm:cert_promoted_key_blocks_total"),
                         ("promoted_value_blocks", "vllm:cert_promoted_value_blocks_total")):  # fmt: skip
        assert certs[0][name] + certs[1][name] == _delta(after, before, series)
    audits = sum(_delta(after, before, f'vllm:cert_audits_total{{rung="{r}"}}') for r in range(5))
    assert certs[0]["audits"] + certs[1]["audits"] == audits
    assert max(c["bound_relative_max"] for c in certs) <= 0.001
    assert torch.tensor([float(c["bound_max"]) for c in certs]).gt(0).all()
