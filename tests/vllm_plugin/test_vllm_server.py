"""``certvllm serve``: the OpenAI-compatible server with ``--kv-cache-dtype certified`` and its metrics.

The server is the session's shared one (``certified_server`` in tests/conftest.py, also scraped by
tests/test_deploy.py): the default preset with ``--cert-bound-tol 0.001``, so some head-steps fall back to rung 3;
every assertion here holds whatever the rung (each generated token is counted once per layer and head, the
bound histograms and page-in counters grow with the certified ones, blocks are freed).
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from servers import SERVED_NAME, abandon_stream, http_post, scrape, wait_idle

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = SERVED_NAME
LAYERS, HEADS = 30, 9


@pytest.fixture
def server(certified_server: str) -> str:
    """The session's shared ``certvllm serve`` (tests/conftest.py: ``certified_server``)."""
    return certified_server


def _settled_metrics(base: str) -> dict[str, float]:
    """Scrape until two scrapes agree on the head-steps of every rung (worker metrics are flushed every 0.25 s)."""
    previous = scrape(base)
    for _ in range(20):
        time.sleep(0.5)
        current = scrape(base)
        if _head_steps(current) == _head_steps(previous):
            return current
        previous = current
    return previous


def _head_steps(m: dict[str, float]) -> float:
    return sum(m.get(f'vllm:cert_head_steps_total{{rung="{r}"}}', 0.0) for r in range(5))


def test_completions_chat_streaming_and_metrics(server):
    before = _head_steps(_settled_metrics(server))
    comp = http_post(server + "/v1/completions",
                 {"model": NAME, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0})  # fmt: skip
    assert "Paris" in comp["choices"][0]["text"]
    chat = http_post(server + "/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16, "temperature": 0})  # fmt: skip
    assert chat["choices"][0]["message"]["content"]
    body = {"model": NAME, "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 10,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    req = urllib.request.Request(server + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    chunks, usage = [], None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                if event["choices"]:
                    chunks.append(event["choices"][0]["delta"].get("content") or "")
    assert "".join(chunks) and usage is not None

    generated = [comp["usage"]["completion_tokens"], chat["usage"]["completion_tokens"], usage["completion_tokens"]]
    m = _settled_metrics(server)
    # each generated token after the first is one decode step of every layer and query head
    assert _head_steps(m) - before == sum(g - 1 for g in generated) * LAYERS * HEADS
    for name in ("vllm:cert_e_key_count", "vllm:cert_e_val_count", "vllm:cert_host_tier_bytes",
                 "vllm:cert_promoted_key_blocks_total", "vllm:cert_page_in_bytes_total"):  # fmt: skip
        assert m.get(name, 0) > 0, name
    assert m.get("vllm:num_requests_running") == 0


def test_aborted_stream_frees_its_blocks(server):
    body = {"model": NAME, "prompt": "Write a long story about a dragon.", "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    abandon_stream(server, body, timeout=120)
    m = wait_idle(server, timeout=30)
    assert m.get("vllm:num_requests_running") == 0
    assert m.get("vllm:kv_cache_usage_perc") == 0
    # the server still serves
    ok = http_post(server + "/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert ok["choices"][0]["text"] is not None
