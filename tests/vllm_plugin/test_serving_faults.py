"""Faults inside a serving ``certvllm serve`` (issue 19 items 2 and 4), one server for the whole module.

The server runs the bundled model with ``--api-key`` and vLLM's ``--worker-extension-cls fault_worker.FaultInjector``:
the test-only module tests/vllm_plugin/fault_worker.py, imported by the worker alone, takes fault commands from a
folder of this test (see its docstring). Nothing in certvllm reads that folder or knows the module. In order:

1. ``--api-key`` on every route: each route the server registered (its startup log lists them all, hidden ones
   included) answers 401 without the key and with a wrong key, unless it is one of the probe, metrics and
   documentation routes that stay open by design (``OPEN_ROUTES``);
2. device pages corrupted under a running request (value scales × 16 in every full block of the long request,
   every layer), the audit at rate 1.0: violations counted and sent to exact attention, the request answered in
   full, a concurrent short request untouched (no violation at its context lengths);
3. the audit's page-ins failing (on the CPU they are the worker's only page-ins), then the compiled kernel running
   out of host memory: the layer calls are recomputed exactly, counted (``reason="page_in"`` / ``"host_memory"``),
   the requests answered;
4. afterwards nothing in use: no request running, no KV block in use, the host tier unchanged;
5. the worker process killed mid-request (SIGKILL): the streaming client gets vLLM's error event and the end of the
   stream within seconds, a new request an HTTP 500, the server exits, and no process of its group is left.

About 3 minutes on this 2-core machine (server start ~60-90 s, the rest requests at audit rate 1.0).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from servers import SERVED_NAME, alive_in_group, certified_serve_command, free_port, scrape, serve_env, serving

from certvllm.vllm_plugin import auth

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KEY = "fault-test-key"
HERE = Path(__file__).resolve().parent
GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's own check (serve/middleware/authenticate.py)
OPEN_ROUTES = {"/health", "/ping", "/version", "/load", "/metrics", "/kv_event_sources", "/openapi.json", "/docs",
               "/docs/oauth2-redirect", "/redoc"}  # fmt: skip
"""Routes that stay open with a key: probes, Prometheus, the load and KV-event-source info, the API description."""
ROUTE_LINE = re.compile(r"Route: (\S+), Methods: (.+)$")


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory) -> Any:
    from servers import SERVER_MODEL

    from certvllm.models import prepare_default_model

    prepare_default_model(SERVER_MODEL)
    folder = tmp_path_factory.mktemp("faults")
    port = free_port()
    env = serve_env(kv_cache_gib=1)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    env["CERTVLLM_TEST_FAULT_DIR"] = str(folder)
    extra = ("--api-key", KEY, "--worker-extension-cls", "fault_worker.FaultInjector")
    cmd = certified_serve_command(port, max_model_len=2048, cert_args=("--cert-config", "default"), extra=extra)
    log = folder / "serve.log"
    with serving(cmd, port, env, log, start_timeout=400) as (base, proc):
        yield SimpleNamespace(base=base, proc=proc, folder=folder, log=log, seq=[0], start=scrape(base), host_tier=None)


def _request(base: str, path: str, body: Any = None, key: str | None = KEY, method: str = "POST",
             timeout: float = 300) -> tuple[int, str]:  # fmt: skip
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if method in ("GET", "HEAD") else json.dumps({} if body is None else body).encode()
    req = urllib.request.Request(base + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _complete(base: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    status, text = _request(base, "/v1/completions", body)
    assert status == 200, text[:500]
    return json.loads(text)


def _command(server: Any, **command: Any) -> None:
    """Hand the worker a fault command (applied before its next certified layer call)."""
    server.seq[0] += 1
    tmp = server.folder / "control.json.tmp"
    tmp.write_text(json.dumps({"seq": server.seq[0], **command}))
    tmp.replace(server.folder / "control.json")


def _state(server: Any) -> dict[str, Any]:
    state = json.loads((server.folder / "state.json").read_text())
    assert state["seq"] == server.seq[0], "the worker did not take the last command"
    return state


def _delta(after: dict[str, float], before: dict[str, float], prefix: str) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix))


def _settled(base: str) -> dict[str, float]:
    """A scrape once the worker's metrics have been flushed (two scrapes 0.5 s apart agree on the audits)."""
    previous = scrape(base)
    for _ in range(40):
        time.sleep(0.5)
        current = scrape(base)
        keys = ("vllm:cert_audits_total", "vllm:cert_layer_fallbacks_total", "vllm:cert_head_steps_total")
        if all(_delta(current, previous, k) == 0 for k in keys):
            return current
        previous = current
    return previous


# -- 1. the API key on every route -------------------------------------------------------------------------------
def test_the_api_key_guards_every_route_but_the_probes(fault_server):
    routes: dict[str, set[str]] = {}
    for line in fault_server.log.read_text().splitlines():
        match = ROUTE_LINE.search(line)
        if match:
            routes.setdefault(match.group(1), set()).update(m.strip() for m in match.group(2).split(","))
    assert "/v1/completions" in routes and "/tokenize" in routes and "/generative_scoring" in routes, routes
    guarded = {p for p in routes if p.startswith(GUARDED_PREFIX) or auth.guarded(p)}
    unexpected = set(routes) - guarded - OPEN_ROUTES
    assert not unexpected, f"routes open without the key that are not probes or docs: {sorted(unexpected)}"
    checked = 0
    for path in sorted(guarded):
        url_path = re.sub(r"\{[^}]+\}", "x", path)
        for method in sorted(routes[path] - {"HEAD"}):
            for key in (None, "wrong-key"):
                status, text = _request(fault_server.base, url_path, key=key, method=method, timeout=30)
                assert status == 401 and "Unauthorized" in text, (method, path, key, status, text[:200])
                checked += 1
    must = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/responses", "/inference/v1/generate",
            "/tokenize", "/detokenize", "/invocations", "/generative_scoring", "/scale_elastic_ep"}  # fmt: skip
    assert must <= guarded and checked == 2 * sum(len(routes[p] - {"HEAD"}) for p in guarded)
    # with the key they are served: one vLLM route, one of the routes certvllm guards, and a completion
    assert _request(fault_server.base, "/v1/models", method="GET")[0] == 200
    assert _request(fault_server.base, "/tokenize", {"model": SERVED_NAME, "prompt": "Hello"})[0] == 200
    assert _complete(fault_server.base, [1000, 1001, 1002], 2)["usage"]["completion_tokens"] == 2
    for path in ("/health", "/metrics", "/version"):  # the probes stay open
        assert _request(fault_server.base, path, key=None, method="GET")[0] == 200


# -- 2. corrupted pages under a running request ---------------------------------------------------------------
def test_corrupted_pages_are_caught_and_every_request_is_answered(fault_server):
    base = fault_server.base
    before = _settled(base)
    fault_server.host_tier = before["vllm:cert_host_tier_bytes"]  # bound by now (at the first request: see below)
    _command(fault_server, kind="corrupt", field="value_scales", mask=1 << 12, min_len=400, audit_rate=1.0)
    answers: dict[str, Any] = {}

    def run(name: str, prompt: list[int]) -> None:
        answers[name] = _complete(base, prompt, 6)

    threads = [threading.Thread(target=run, args=("long", list(range(1000, 1600)))),
               threading.Thread(target=run, args=("short", list(range(2000, 2050))))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in ("long", "short"):
        choice = answers[name]["choices"][0]
        assert choice["finish_reason"] == "length" and answers[name]["usage"]["completion_tokens"] == 6, name
    state = _state(fault_server)
    assert state["corrupted"] >= 30 * 37  # 37 full blocks of the 600-token prompt in each of the 30 layers
    assert state["violations"] > 0 and min(state["violation_lens"]) >= 600  # the long request only
    after = _settled(base)
    audits = _delta(after, before, "vllm:cert_audits_total")
    violations = _delta(after, before, "vllm:cert_audit_violations_total")
    fallbacks = sum(v - before.get(k, 0.0) for k, v in after.items()
                    if k.startswith("vllm:cert_layer_fallbacks_total") and 'reason="audit"' in k)  # fmt: skip
    assert violations == state["violations"] > 0 and audits == state["audited"]
    assert fallbacks > 0  # the long request ran exactly in the layers the audit caught
    print(f"corrupted pages: {state['corrupted']}, audited head-steps {audits:.0f}, violations {violations:.0f} at "
          f"context lengths {state['violation_lens'][0]}-{state['violation_lens'][-1]}, audit fallbacks (rows x "
          f"layer calls) {fallbacks:.0f}; answers: long {answers['long']['choices'][0]['text']!r}, short "
          f"{answers['short']['choices'][0]['text']!r}")  # fmt: skip
    _command(fault_server, kind="none")


# -- 3. failed page-ins and exhausted host memory while serving --------------------------------------------------
@pytest.mark.parametrize("kind,reason", [("page_in", "page_in"), ("host_memory", "host_memory")])
def test_failed_page_ins_and_exhausted_host_memory_fall_back_to_exact(fault_server, kind, reason):
    base = fault_server.base
    before = _settled(base)
    _command(fault_server, kind=kind, times=3, audit_rate=1.0)
    out = _complete(base, list(range(3000 + 200 * len(kind), 3100 + 200 * len(kind))), 4)
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "length"
    state = _state(fault_server)
    assert state[f"{kind}_faults"] == 3
    after = _settled(base)
    counted = sum(v - before.get(k, 0.0) for k, v in after.items()
                  if k.startswith("vllm:cert_layer_fallbacks_total") and f'reason="{reason}"' in k)  # fmt: skip
    assert counted == 3  # three layer calls of one row each, recomputed exactly
    assert "its 1 rows of this step were recomputed exactly" in fault_server.log.read_text()
    _command(fault_server, kind="none")
    assert _complete(base, [5, 6, 7, 8], 2)["usage"]["completion_tokens"] == 2
    assert _state(fault_server)[f"{kind}_faults"] == 0  # off again


# -- 4. nothing left in use -------------------------------------------------------------------------------------
def test_nothing_is_left_in_use_after_the_faults(fault_server):
    deadline = time.monotonic() + 60
    while True:
        m = scrape(fault_server.base)
        idle = m.get("vllm:num_requests_running") == 0 and m.get("vllm:kv_cache_usage_perc") == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert idle, {k: v for k, v in m.items() if "running" in k or "usage" in k}
    assert m["vllm:cert_host_tier_bytes"] == fault_server.host_tier > 0
    # the shadow is one allocation per layer, made when the layer's first token is written (the first request, not
    # the startup: its gauge is absent before)
    assert "vllm:cert_host_tier_bytes" not in fault_server.start


# -- 5. a killed worker ---------------------------------------------------------------------------------------
def test_a_killed_worker_ends_in_a_clean_error_and_leaves_no_process(fault_server):
    base, proc = fault_server.base, fault_server.proc
    worker = json.loads((fault_server.folder / "state.json").read_text())["pid"]
    assert worker != proc.pid and os.getpgid(worker) == proc.pid  # the worker of this server's process group
    body = {"model": SERVED_NAME, "prompt": list(range(4000, 4100)), "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})  # fmt: skip
    stream = urllib.request.urlopen(req, timeout=120)
    received = [stream.readline() for _ in range(6)]  # three tokens (data line + blank line each)
    assert all(line.startswith(b"data: {") for line in received[::2]), received
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    rest = []
    while line := stream.readline():  # must end, not hang (the 120 s socket timeout would raise)
        if line.strip():
            rest.append(line.decode())
    ended = time.monotonic() - killed
    print(f"killed worker {worker}: the stream ended {ended:.2f} s later with {rest}")
    assert ended < 30, ended
    assert rest[-1].strip() == "data: [DONE]", rest
    errors = [json.loads(x.removeprefix("data: ")) for x in rest if x.startswith('data: {"error"')]
    assert len(errors) == 1 and errors[0]["error"]["code"] == 500, rest
    # the engine is dead: a new request gets a clean 500, or no connection once the server is going down
    try:
        status, text = _request(base, "/v1/completions", {"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 2},
                                timeout=30)  # fmt: skip
        assert status == 500 and "EngineCore" in text, (status, text[:300])
        print("a new request after the kill: HTTP 500", text[:200])
    except (urllib.error.URLError, ConnectionError) as err:
        print(f"a new request after the kill: no connection ({err!r})")
    proc.wait(timeout=120)  # the API server shuts itself down
    print(f"the server exited {time.monotonic() - killed:.1f} s after the kill, code {proc.returncode}")
    assert proc.returncode is not None
    assert not alive_in_group(proc.pid), "processes of the server's group left behind"
    log = fault_server.log.read_text()
    assert re.search(r"Worker proc VllmWorker-0 died unexpectedly \(exit code: (-9|None)\)", log)
