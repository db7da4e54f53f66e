"""The engine harness's own behaviour (no engine): a run whose engine core dies ends, with the log, instead of
waiting for outputs that will not come."""

from __future__ import annotations

import os
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


def test_a_stalled_run_is_stopped_with_every_threads_stack_in_its_log(tmp_path, monkeypatch):
    """No phase for ``stall_timeout`` seconds: the run's session gets SIGABRT, its Python processes write their
    threads' stacks (PYTHONFAULTHANDLER, as the harness sets for engines), and the error says so."""
    monkeypatch.setattr(harness, "STALL_DUMP_GRACE_S", 5.0)
    log, progress = tmp_path / "log.txt", tmp_path / "progress.jsonl"
    script = (f"import json, time\nopen({str(progress)!r}, 'a').write(json.dumps({{'phase': 0}}) + '\\n')\n"
              "def stuck_in_a_phase():\n    time.sleep(120)\nstuck_in_a_phase()\n")  # fmt: skip
    phases = []
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**harness.os.environ, **harness.ENGINE_ENV})  # fmt: skip
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="no phase finished for 2 s"):
            harness._follow(proc, progress, phases.append, 60.0, log, stall_timeout=2.0)
    assert phases == [{"phase": 0}] and time.monotonic() - start < 20.0
    assert proc.poll() is not None  # stopped, not left behind
    assert "stuck_in_a_phase" in log.read_text()  # the stack of the thread that hung


def test_a_run_past_its_time_limit_is_stopped_with_a_clear_error(tmp_path):
    """``timeout`` (``certvllm eval --time-limit``) ends the run's whole session with an error that says why."""
    phases = []
    with (tmp_path / "log.txt").open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        with pytest.raises(RuntimeError, match=r"time limit \(2 s\) was reached"):
            harness._follow(proc, tmp_path / "progress.jsonl", phases.append, 2.0, tmp_path / "log.txt")
    assert proc.poll() is not None and phases == []


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


def test_prompt_logprobs_align_in_both_vllm_conventions():
    """A prefix-cache hit of 4 tokens in a 7-token prompt: positions 5 and 6 are scored. vLLM 0.32 returns one entry
    per position (the uncomputed ones None); vLLM 0.26 returns its leading None and the computed positions only.
    Both must give the same per-position list (the H200 run of 2026-12-02 scored nothing before this alignment)."""

    class Lp:
        def __init__(self, logprob: float) -> None:
            self.logprob = logprob

    ids = [10, 11, 12, 13, 14, 15, 16]
    at5, at6 = {15: Lp(-1.5), 99: Lp(-0.1)}, {16: Lp(-2.5)}  # rows 4 and 5 predict positions 5 and 6
    full = [None, None, None, None, None, at5, at6]  # 0.32: as long as the prompt
    short = [None, at5, at6]  # 0.26: a leading None, then what was computed
    want = [None, None, None, None, None, -1.5, -2.5]
    assert harness.align_prompt_logprobs(ids, full, cached=4) == want
    assert harness.align_prompt_logprobs(ids, short, cached=4) == want
    assert harness.align_prompt_logprobs(ids, [None], cached=6) == [None] * 7  # nothing computed after the cache
    with pytest.raises(ValueError, match="misaligned: position 5"):  # a list one entry too long for its computed part
        harness.align_prompt_logprobs(ids, [None, at5, at6, {17: Lp(-0.2)}], cached=4)
    with pytest.raises(ValueError, match="8 prompt log-probability entries"):
        harness.align_prompt_logprobs(ids, [None] * 8, cached=0)


def test_a_perplexity_window_without_a_scored_token_is_an_error_not_a_result():
    from certvllm.eval.scoring import score_perplexity

    with pytest.raises(ValueError, match="no prompt log-probability after the 4 cached tokens"):
        score_perplexity({"id": "ppl-4k-0", "token_ids": [0] * 7}, [None] * 7, cached_tokens=4)


def test_a_terminated_parent_stops_its_engine_session_first(tmp_path):
    """``SIGTERM`` to the process following a run (``timeout`` around a benchmark) ends the engine's session
    too: the engine lives in its own session and would otherwise outlive its parent, holding the GPU."""
    pid_file = tmp_path / "engine.pid"
    parent = (
        "import subprocess, sys\n"
        "from pathlib import Path\n"
        "from certvllm.vllm_plugin import harness\n"
        "proc = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        f"Path({str(pid_file)!r}).write_text(str(proc.pid))\n"
        f"harness._follow(proc, Path({str(tmp_path / 'progress.jsonl')!r}), lambda _: None, 100.0)\n"
    )
    follower = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 60.0
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and follower.poll() is None, "the follower did not start its engine"
        time.sleep(0.1)
    engine_pid = int(pid_file.read_text())
    time.sleep(1.5)  # the follower is inside _follow's wait loop
    follower.terminate()
    assert follower.wait(timeout=30) == 128 + 15
    with pytest.raises(ProcessLookupError):  # gone (the follower reaped it), not orphaned
        os.kill(engine_pid, 0)


def test_a_profiled_phase_ranks_its_functions_by_own_and_total_time():
    import cProfile

    def leaf(n: int) -> int:
        return sum(i * i for i in range(n))

    def caller() -> int:
        return sum(leaf(20000) for _ in range(20))

    profiler = cProfile.Profile()
    with profiler:
        caller()
    summary = harness.profile_summary(profiler, top=5)
    assert set(summary) == {"tottime", "cumtime"}
    for key, rows in summary.items():
        assert 1 <= len(rows) <= 5
        assert [r[key] for r in rows] == sorted((r[key] for r in rows), reverse=True)
        assert all(r["cumtime"] >= r["tottime"] >= 0 for r in rows)
    # the caller includes the leaf's time (cumtime) and is ranked at or above it there
    cum = [r["function"] for r in summary["cumtime"]]
    by_name = {r["function"].rsplit("(", 1)[1].rstrip(")"): r for r in summary["cumtime"]}
    assert "caller" in by_name and "leaf" in by_name, cum
    assert by_name["caller"]["cumtime"] >= by_name["leaf"]["cumtime"]
    assert by_name["leaf"]["calls"] == 20
