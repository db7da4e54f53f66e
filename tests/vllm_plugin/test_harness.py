"""The engine harness's own behaviour (no engine): a run whose engine core dies ends, with the log, instead of
waiting for outputs that will not come."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from certvllm.vllm_plugin import harness


def test_a_dead_engine_core_ends_the_run_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "DEATH_GRACE_S", 0.5)
    log = tmp_path / "log.txt"
    script = "import time; print('(EngineCore) engine core exited unexpectedly', flush=True); time.sleep(120)"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="engine core died"):
            harness._follow(proc, tmp_path / "progress.jsonl", lambda _: None, 60.0, log)
    assert time.monotonic() - start < 10.0
    assert proc.poll() is not None  # killed, not left behind


def test_a_healthy_run_is_followed_to_its_exit(tmp_path):
    log = tmp_path / "log.txt"
    progress = tmp_path / "progress.jsonl"
    script = (f"import json, time; open({str(progress)!r}, 'a').write(json.dumps({{'phase': 1}}) + '\\n'); "
              "time.sleep(1.5); print('done', flush=True)")  # fmt: skip
    phases = []
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT)
        assert harness._follow(proc, progress, phases.append, 60.0, log) == 0
    assert phases == [{"phase": 1}]


def test_a_failure_report_starts_at_the_first_error_when_the_tail_is_only_teardown():
    teardown = ["INFO teardown " + "x" * 80] * 200
    log = "\n".join(["INFO start"] * 5 + ["(Worker pid=1) ERROR boom: the real reason", *teardown])
    report = harness.first_errors(log)
    assert report.startswith("first error lines:") and "the real reason" in report
    assert harness.first_errors("INFO fine\n(Worker) ERROR short log") == ""  # the tail shows it already
