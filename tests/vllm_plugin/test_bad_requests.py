"""Bad requests against ``certvllm serve`` (issue 19 item 4): each gets a clear client error (4xx naming the
problem), a request with ``prompt_logprobs`` is served, one that tries to pass certvllm settings is served with the
server's own, and the server keeps serving afterwards with nothing left in use. The shared server of the session
(tests/conftest.py ``certified_server``: max_model_len 2048)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from servers import SERVED_NAME, http_post, wait_idle

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_LEN = 2048


def _post_raw(url: str, data: bytes) -> tuple[int, str]:
    """POST ``data`` as JSON; (status, body) for errors as for successes."""
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _completion(base: str, **body: object) -> tuple[int, str]:
    return _post_raw(base + "/v1/completions", json.dumps({"model": SERVED_NAME, **body}).encode())


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"prompt": [17] * (MAX_LEN + 10), "max_tokens": 4}, "maximum context length"),
        ({"prompt": "The capital of France is", "max_tokens": MAX_LEN + 100}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 4, "temperature": "hot"}, "temperature"),
    ],
    ids=["prompt_over_max_model_len", "max_tokens_beyond_context", "negative_max_tokens", "bad_temperature"],
)
def test_a_bad_completion_request_gets_a_client_error_naming_it(certified_server, body, needle):
    status, text = _completion(certified_server, **body)
    assert 400 <= status < 500, (status, text[:300])
    assert needle in text, text[:500]


def test_malformed_json_gets_a_client_error(certified_server):
    status, text = _post_raw(certified_server + "/v1/completions", b'{"model": "smollm2", "prompt": ')
    assert 400 <= status < 500, (status, text[:300])


def test_a_request_cannot_carry_certvllm_settings(certified_server):
    """The only per-request free-form field vLLM 0.32 passes to the engine is ``vllm_xargs`` (``SamplingParams.
    extra_args``); certvllm reads its settings from the engine's ``additional_config`` alone, so invalid values sent
    that way are ignored: the request is served with the server's settings (tests/vllm_plugin/test_bad_settings.py:
    invalid settings of the server itself are refused at startup)."""
    body = {"model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
            "vllm_xargs": {"certvllm": "x", "v_tol": -1, "audit_policy": "panic"}}  # fmt: skip
    status, text = _post_raw(certified_server + "/v1/completions", json.dumps(body).encode())
    assert status == 200, text[:300]
    assert json.loads(text)["usage"]["completion_tokens"] == 3


def test_prompt_logprobs_are_served_and_the_server_stays_healthy(certified_server):
    body = {"model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "prompt_logprobs": 1}  # fmt: skip
    out = http_post(certified_server + "/v1/completions", body)
    choice = out["choices"][0]
    assert choice["text"] and choice.get("prompt_logprobs")
    # after every bad request above and this one, the server still answers and holds no blocks
    body = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    again = http_post(certified_server + "/v1/completions", body)
    assert again["usage"]["completion_tokens"] == 2
    idle = wait_idle(certified_server)
    assert idle.get("vllm:kv_cache_usage_perc") == 0 and idle.get("vllm:num_requests_running") == 0
