"""Invalid certvllm settings arriving through ``--additional-config`` (issue 19 item 4).

In vLLM 0.32 an engine's ``additional_config`` is fixed for its lifetime and no request can carry certvllm
settings (``vllm_xargs`` go to ``SamplingParams.extra_args``, which certvllm never reads: tested against the shared
server in test_bad_requests.py). So an invalid value cannot reach a worker of a running server; it is refused at
startup, in this order:

* ``certvllm serve`` checks the ``certvllm`` object of ``--additional-config`` together with the ``--cert-*`` flags
  before vLLM is imported: ``certvllm:`` lines naming the field, the value and the fix, exit code 2, no traceback;
* plain ``vllm serve`` (and ``LLM(...)``): the plugin's platform check validates the settings while vLLM builds its
  config in the API-server process, before any engine process starts. vLLM prints that as its own traceback
  (exit code 1) whose last lines are certvllm's message: vLLM's CLI, which certvllm does not patch, decides the
  format there.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from certvllm.cli import build_serve_args, main

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "models" / "smollm2-135m-instruct")

BAD = [
    ({"v_tol": -1}, ["v_tol: Input should be greater than or equal to 0", "got -1", "--cert-v-tol"]),
    ({"audit_policy": "panic"}, ["audit_policy", "'panic'", "--cert-audit-policy"]),
    ({"value_group_size": 12}, ["value_group_size", "got 12", "--cert-value-group-size"]),
    ({"tau_cov": "lots"}, ["tau_cov", "'lots'", "--cert-tau-cov"]),
    ({"no_such_field": 1}, ["no_such_field: Extra inputs are not permitted"]),
    ({"preset": "nope"}, ["unknown certvllm preset 'nope'"]),
]
IDS = ["negative_v_tol", "unknown_policy", "bad_group", "wrong_type", "unknown_field", "unknown_preset"]


@pytest.fixture(scope="module")
def model() -> str:
    from certvllm.models import prepare_default_model

    prepare_default_model(Path(MODEL))
    return MODEL


@pytest.mark.parametrize("settings,needles", BAD, ids=IDS)
def test_certvllm_serve_refuses_bad_additional_config_before_vllm(settings, needles, capsys):
    argv = ["serve", "some/model", "--port", "1", "--additional-config", json.dumps({"certvllm": settings})]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("certvllm: activation dtype")]
    assert lines[0].startswith(f"certvllm: --additional-config {json.dumps({'certvllm': settings})}: "), lines
    assert all(n in err for n in needles), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "text,needle",
    [
        ('{"certvllm": 3}', '"certvllm" must be a JSON object of certvllm settings'),
        ('{"certvllm": ', "--additional-config is not valid JSON"),
        ("[1, 2]", "--additional-config must be a JSON object"),
    ],
)
def test_malformed_additional_config_is_a_usage_error(text, needle, capsys):
    assert main(["serve", "some/model", "--port", "1", "--additional-config", text]) == 2
    assert needle in capsys.readouterr().err


def test_flags_override_additional_config_and_the_merge_is_checked(model, capsys):
    """``--cert-*`` flags win over the JSON's fields; the merged settings are what every process gets. A host budget in
    the JSON goes through the early refusal too (it used to reach vLLM's config check unjudged)."""
    text = '{"certvllm": {"v_tol": -1, "k_max": 64}, "other": 2}'
    args, extra = build_serve_args([model, "--additional-config", text, "--cert-v-tol", "0.02"])
    assert extra == {"other": 2, "certvllm": {"v_tol": 0.02, "k_max": 64}} and "--additional-config" not in args
    budget = '{"certvllm": {"host_memory_gb": 0.01}}'
    argv = ["serve", model, "--max-model-len", "8192", "--dtype", "bfloat16", "--additional-config", budget]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "host" in line]
    assert len(err) == 1 and err[0].startswith("certvllm: --cert-host-memory-gb 0.01 cannot hold the host shadow")


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[Any, float]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True)
    return proc, time.perf_counter() - start


@pytest.mark.vllm
def test_certvllm_serve_refuses_in_seconds_with_exit_code_2(model):
    script = Path(sys.executable).parent / "certvllm"
    bad = json.dumps({"certvllm": {"v_tol": -1}})
    proc, seconds = _run([str(script), "serve", model, "--port", "1", "--additional-config", bad], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    refusal = [line for line in proc.stderr.splitlines() if "--additional-config" in line]
    assert len(refusal) == 1 and refusal[0].startswith("certvllm: --additional-config ")
    assert "--cert-v-tol" in proc.stderr
    assert seconds < 15  # before vLLM is imported (it used to fail after ~22 s with a 64-line traceback, exit 1)


@pytest.mark.vllm
@pytest.mark.slow
def test_plain_vllm_serve_refuses_at_startup_before_any_engine_process(model):
    """What a plain ``vllm serve`` user sees: the refusal comes from the config check in the API-server process (no
    engine core is started, nothing listens), as vLLM's traceback ending in certvllm's message."""
    vllm = Path(sys.executable).parent / "vllm"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    bad = json.dumps({"certvllm": {"v_tol": -1}})
    cmd = [str(vllm), "serve", model, "--kv-cache-dtype", "certified", "--max-model-len", "2048", "--port", "1",
           "--additional-config", bad]  # fmt: skip
    proc, seconds = _run(cmd, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "EngineCore" not in out and "Starting vLLM API server" not in out  # refused before either
    tail = "\n".join(out.strip().splitlines()[-6:])
    assert "invalid certvllm config" in tail and "v_tol: Input should be greater than or equal to 0" in tail, tail
    assert "--cert-v-tol" in tail
    print(f"plain vllm serve refused in {seconds:.1f} s, exit {proc.returncode}; last lines:\n{tail}")


# -- in-process: every bad value is refused while vLLM builds the engine config ---------------------------------------
@contextlib.contextmanager
def _environ_kept():
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _engine_config(model: str, additional_config: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    from certvllm.vllm_plugin import register

    register()
    args = EngineArgs(model=model, kv_cache_dtype="certified", enforce_eager=True, max_model_len=2048,
                      additional_config=additional_config)  # fmt: skip
    with _environ_kept():
        return args.create_engine_config()


@pytest.mark.vllm
@pytest.mark.parametrize("settings,needles", [*BAD, (7, ['additional_config["certvllm"] must be a JSON object'])],
                         ids=[*IDS, "not_an_object"])  # fmt: skip
def test_vllms_config_check_refuses_every_bad_value(model, settings, needles):
    with pytest.raises(ValueError) as info:  # pydantic's ValidationError is a ValueError
        _engine_config(model, {"certvllm": settings})
    msg = str(info.value)
    assert all(n in msg for n in needles), msg
