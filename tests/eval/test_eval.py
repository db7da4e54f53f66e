"""``certvllm eval``: scorers, statistics, items and the report (fast), and a smoke run through the
engine (``slow``, ``vllm``): 1K context, perplexity + NIAH + RULER + a tasks file, dense vs certified
(one engine per config for every task), then a rerun that must find everything done."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from certvllm.eval import report, runner, scoring, stats, tasks

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "models" / "smollm2-135m-instruct")
LAYERS, HEADS = 30, 9


# -- fast: no engine, no downloads --------------------------------------------------------------------
def test_scorers_follow_ruler_and_exact_match():
    assert scoring.string_match_all("Answer: apple, PEAR", ["apple", "pear", "fig"]) == pytest.approx(2 / 3)
    assert scoring.string_match_part("it is Paris.", ["London", "paris"]) == 1.0
    assert scoring.niah_exact(" 1234567.", ["1234567"]) == 1.0
    assert scoring.niah_exact(" 12345678", ["1234567"]) == 0.0  # a longer number is not the needle
    item = {"metric": "all", "answers": ["a1", "b2"]}
    assert scoring.score_generation(item, "a1 b2") == {"score": 1.0, "correct": True}
    assert scoring.score_generation(item, "a1") == {"score": 0.5, "correct": False}
    ppl = scoring.score_perplexity({"token_ids": [0] * 6}, [None, None, None, None, -1.0, -3.0], cached_tokens=3)
    assert ppl["n_tokens"] == 2 and ppl["ppl"] == pytest.approx(math.exp(2.0))


def test_statistics():
    ref = [True] * 10 + [False] * 2
    worse = [True] * 4 + [False] * 8
    m = stats.mcnemar_exact(ref, worse)
    assert (m["b"], m["c"]) == (6, 0) and m["p"] == pytest.approx(2 * 0.5**6)
    assert stats.mcnemar_exact(ref, ref)["p"] == 1.0
    lo, hi = stats.mean_ci([1, 0, 1, 1, 0, 1, 1, 1], seed=0)
    assert 0.0 <= lo < 0.75 < hi <= 1.0
    assert stats.paired_delta_ci([1, 1, 0], [1, 1, 0], seed=0) == [0.0, 0.0]
    ci = stats.ppl_delta_ci([100.0, 200.0, 150.0], [101.0, 199.0, 152.0], [50, 60, 55], seed=0)
    assert ci[0] <= 0.0 <= ci[1]
    assert stats.mean_ci([1.0], seed=0) is None


def test_configs_contexts_and_tasks_file(tmp_path):
    assert tasks.parse_context("4k") == 4096 and tasks.parse_context("1500") == 1500
    assert runner.parse_config("dense").kv_cache_dtype == "auto"
    assert runner.parse_config("naive").cert == {"preset": "naive"}
    paper = runner.parse_config("certified:paper")
    assert paper.cert == {"preset": "paper"} and paper.slug == "certified-paper"
    with pytest.raises(ValueError):
        runner.parse_config("int4")
    # the stress study's formats: CertConfig overrides after "+", validated at parse time
    stress = runner.parse_config("naive+value_code_levels=3+key_code_levels=15")
    assert stress.cert == {"preset": "naive", "value_code_levels": 3, "key_code_levels": 15}
    assert runner.parse_config("certified+value_code_levels=3").cert == {"value_code_levels": 3}
    assert runner.parse_config("certified:strict+value_code_levels=3").cert["preset"] == "strict"
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        runner.parse_config("naive+value_code_levels")
    with pytest.raises(Exception, match="value_code_levels"):
        runner.parse_config("naive+value_code_levels=0")
    ppl_spec = runner.engine_spec(paper, "ppl", runner.Options(model="m", out=tmp_path), 1024)
    assert ppl_spec["cert"]["prefill"] == "certified" and ppl_spec["engine"]["enable_prefix_caching"]
    gen_spec = runner.engine_spec(paper, "gen", runner.Options(model="m", out=tmp_path), 1024)
    assert "prefill" not in gen_spec["cert"]
    # one engine for both families: perplexity's settings, and generation prompts prefilled whole with no
    # cached context (never chunked, never reading the prefix cache), so still exactly
    both = runner.engine_spec(paper, ["ppl", "gen"], runner.Options(model="m", out=tmp_path), 1024)
    assert both["cert"]["prefill"] == "certified" and both["engine"]["enable_prefix_caching"]
    assert both["engine"]["enable_chunked_prefill"] is False and both["engine"]["max_num_batched_tokens"] >= 1024
    gen_requests = runner._requests([{"prompt": "p", "max_tokens": 4}], "gen")["requests"]
    assert gen_requests == [{"prompt": "p", "max_tokens": 4, "skip_reading_prefix_cache": True}]
    certified_gen = runner.Options(model="m", out=tmp_path, prefill="certified")  # chunked: an engine of its own
    with pytest.raises(ValueError, match="engine of its own"):
        runner.engine_spec(paper, ["ppl", "gen"], certified_gen, 1024)
    assert runner.engine_spec(paper, "gen", certified_gen, 1024)["cert"]["prefill"] == "certified"
    f = tmp_path / "qa.jsonl"
    f.write_text('{"prompt": "2+2=", "answers": ["4"]}\n\n{"prompt": "Capital of France?", "answers": ["Paris"], '
                 '"metric": "all", "max_tokens": 8}\n')  # fmt: skip
    items = tasks.load_tasks_file(f, None)
    assert [it["task"] for it in items] == ["file:qa", "file:qa"] and items[1]["max_tokens"] == 8
    assert items[0]["hash"] == tasks.load_tasks_file(f, 1)[0]["hash"]
    f.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="answers"):
        tasks.load_tasks_file(f, None)


def test_gpu_settings_fp8_engine_args_and_cert_fields(tmp_path):
    """The GPU evaluation's settings: ``fp8`` is vLLM's own cache, ``--engine-arg`` reaches every engine (over
    the CPU defaults), ``--cert`` every certvllm config (under the config's own overrides), and what cannot run is
    refused before any engine starts, naming the fix."""
    from certvllm.eval import cli

    fp8 = runner.parse_config("fp8")
    assert (fp8.kv_cache_dtype, fp8.cert) == ("fp8", None)
    with pytest.raises(ValueError, match="unknown config"):
        runner.parse_config("fp8:paper")
    stress = runner.parse_config("certified+value_code_levels=3")
    opts = runner.Options(model="m", out=tmp_path, engine_args={"gpu_memory_utilization": 0.2, "enforce_eager": False},
                          cert_args={"host_memory_gb": 12, "value_code_levels": 15})  # fmt: skip
    spec = runner.engine_spec(stress, "gen", opts, 4096)
    assert spec["engine"]["gpu_memory_utilization"] == 0.2 and spec["engine"]["enforce_eager"] is False
    assert spec["cert"] == {"host_memory_gb": 12, "value_code_levels": 3}  # the config's own field wins
    assert "cert" not in runner.engine_spec(fp8, "gen", opts, 4096)
    assert runner.engine_spec(fp8, "gen", opts, 4096)["kv_cache_dtype"] == "fp8"

    def settings(*argv: str) -> dict:
        args = cli._parser().parse_args(["niah", *argv])
        configs = [runner.parse_config(c) for c in args.configs.split(",")]
        return cli._engine_settings(args, configs)

    got = settings("--device", "cuda", "--engines", "3", "--configs", "dense,fp8,certified",
                   "--engine-arg", "gpu_memory_utilization=0.25", "--cert", "host_memory_gb=12")  # fmt: skip
    assert got == {"engine_args": {"gpu_memory_utilization": 0.25}, "cert_args": {"host_memory_gb": 12},
                   "stall_timeout": 3600.0, "deadline": None}  # fmt: skip
    assert settings("--stall-timeout", "0")["stall_timeout"] is None
    with pytest.raises(ValueError, match="stall-timeout"):
        settings("--stall-timeout", "-1")
    before = time.monotonic()
    assert before + 100 <= settings("--time-limit", "100")["deadline"] <= time.monotonic() + 100
    with pytest.raises(ValueError, match="--time-limit -5: give seconds > 0"):
        settings("--time-limit", "-5")
    with pytest.raises(ValueError, match="--device cuda"):
        settings("--configs", "dense,fp8")
    with pytest.raises(ValueError, match="gpu_memory_utilization=F with F <= 0.30"):
        settings("--device", "cuda", "--engines", "3")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        settings("--engine-arg", "enforce_eager")
    with pytest.raises(ValueError, match="host_memory_gb"):
        settings("--cert", "host_memory_gb=-1")
    assert cli.main(["niah", "--configs", "dense,fp8", "--out", str(tmp_path / "x")]) == 2  # a message, no engine


def test_engines_side_by_side_get_equal_disjoint_cores(monkeypatch):
    """``--engines N``: each engine's worker gets its own cores, as many as every other one's."""
    import os

    from certvllm.vllm_plugin.harness import cpu_binds

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 0, 1, 2, 3}, raising=False)
    assert cpu_binds(2) == ["0,1", "2,3"] and cpu_binds(5) == ["0", "1", "2", "3", "4"]
    assert cpu_binds(1) == [None]  # vLLM's own binding
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert cpu_binds(2) == [None]


def test_store_resume_and_report_from_synthetic_results(tmp_path):
    store = runner.Store(tmp_path)
    dense, cert = runner.parse_config("dense"), runner.parse_config("certified:paper")
    items = [{"id": f"niah-1k-{i}", "hash": f"h{i}", "task": "niah", "context": "1k"} for i in range(6)]
    for cfg, correct in ((dense, [1, 1, 1, 1, 0, 1]), (cert, [1, 1, 0, 1, 0, 1])):
        rows = [{"id": it["id"], "hash": it["hash"], "task": "niah", "context": "1k", "config": cfg.name,
                 "meta": {"depth": 0.1 * i}, "score": float(c), "correct": bool(c), "output": f"v{c}"}
                for i, (it, c) in enumerate(zip(items[:5], correct, strict=False))]  # fmt: skip
        store.append(store.path("niah", "1k", cfg), rows)
    store.append(store.path("niah", "1k", cert, ".phases.jsonl"), [{"ids": ["niah-1k-0"], "seconds": 1.0, "metrics": {
        "vllm:cert_head_steps_total{rung=0}": 90.0, "vllm:cert_head_steps_total{rung=3}": 10.0,
        "vllm:cert_head_fallbacks_total{reason=rank}": 10.0}}])  # fmt: skip
    assert [it["id"] for it in runner.pending(store, items, cert)] == ["niah-1k-5"]
    items[0]["hash"] = "changed"  # new content: no longer done
    assert len(runner.pending(store, items, cert)) == 2
    for i in range(2):
        store.append(store.path("ppl", "1k", dense if i == 0 else cert), [
            {"id": f"ppl-1k-{j}", "hash": "x", "task": "ppl", "context": "1k", "config": (dense, cert)[i].name,
             "nll_sum": 200.0 + j + i * 0.5, "n_tokens": 100, "ppl": math.exp((200.0 + j + i * 0.5) / 100),
             "cached_tokens": 896, "window_tokens": 1024} for j in range(3)])  # fmt: skip
    store.append(store.path("ppl", "2k", cert), [  # a window stored without a scored token (the 2026-12-02 H200 run)
        {"id": "ppl-2k-0", "hash": "x", "task": "ppl", "context": "2k", "config": cert.name, "nll_sum": 0,
         "n_tokens": 0, "ppl": math.nan, "cached_tokens": 1920, "window_tokens": 2048}])  # fmt: skip
    assert store.done("ppl", "2k", cert) == {}  # so a rerun measures it again
    rep = report.build(tmp_path)
    assert "2k" not in rep["perplexity"] and rep["perplexity_unscored"] == {"2k": {"certified:paper": ["ppl-2k-0"]}}
    cell = rep["accuracy"]["niah"]["1k"]["certified:paper"]
    assert cell["n"] == 5 and cell["mcnemar"]["b"] == 1 and cell["mcnemar"]["c"] == 0
    assert rep["perplexity"]["1k"]["certified:paper"]["delta"] > 0
    assert rep["rungs"]["niah"]["certified:paper"]["fallback_rate"] == pytest.approx(0.1)
    agree = rep["agreement"]["1k"]["certified:paper"]  # one output ("v0" for "v1") and its score differ
    assert (agree["n"], agree["identical"], agree["up"], agree["down"], agree["first_diff_chars"]) == (5, 4, 0, 1, 1)
    assert rep["agreement"]["all"]["certified:paper"]["n"] == 5 and "dense" not in rep["agreement"]["1k"]
    text = (tmp_path / "report.md").read_text()
    assert "## Output agreement with the reference" in text
    assert "## Needle in a haystack" in text and "## Perplexity" in text
    for png in ("accuracy_by_context.png", "ppl_delta.png", "rungs.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_a_failed_engine_is_reported_at_once_and_the_others_finish(tmp_path, monkeypatch, capsys):
    """One config's engine fails beside another's: the failure is printed when it happens and recorded in
    runs.jsonl, the other config's results are stored and reported, and the exit status says a config failed."""
    from certvllm.eval import cli

    tasks_file = tmp_path / "t.jsonl"
    tasks_file.write_text('{"prompt": "2+2=", "answers": ["4"]}\n')
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8192}')  # the model folder the CLI reads
    monkeypatch.setattr(cli.tasks, "load_tokenizer", lambda model: lambda text: {"input_ids": [0] * len(text)})

    def run_config(store, by_kind, cfg, opts, cpu_bind=None):
        if cfg.name == "naive":
            raise RuntimeError("engine run failed (exit -9):\nkilled")
        it = by_kind["gen"][0]
        store.append(store.path(it["task"], it["context"], cfg), [{"id": it["id"], "hash": it["hash"],
                     "task": it["task"], "context": it["context"], "config": cfg.name, "meta": {}, "score": 1.0,
                     "correct": True, "output": "4"}])  # fmt: skip
        opts.log.append({"kind": "gen", "config": cfg.name, "items": 1, "phases": 1, "init_seconds": 1.0,
                         "wall_seconds": 2.0, "kv_cache_tokens": 10, "max_model_len": 64})  # fmt: skip
        return 1

    monkeypatch.setattr(cli.runner, "run_config", run_config)
    out = tmp_path / "out"
    status = cli.main(["file", "--tasks-file", str(tasks_file), "--configs", "naive,dense", "--out", str(out),
                       "--model", str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 1, err
    assert "config naive failed" in err and "killed" in err and "1 config(s) failed: naive" in err
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert {r["config"] for r in runs} == {"naive", "dense"}
    assert "exit -9" in next(r for r in runs if "error" in r)["error"]
    assert "| failed | naive |" in (out / "report.md").read_text()


# -- slow: through the engine -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_eval_smoke_through_the_engine(tmp_path):
    from certvllm.eval.cli import main
    from certvllm.models import prepare_default_model

    prepare_default_model(MODEL)
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"prompt": "Q: What is the capital of France?\nA: The capital of France is",
                              "answers": ["Paris"], "max_tokens": 8}) + "\n")  # fmt: skip
    out = tmp_path / "out"
    # the least work that still reaches every statistic: two perplexity windows and two NIAH trials (one
    # item has no bootstrap CI), one sample per RULER task (pooled over the two tasks: two items); the two
    # configs' engines run side by side
    argv = ["all", "--model", MODEL, "--contexts", "1k", "--configs", "dense,certified:paper", "--n", "2",
            "--n-ruler", "1", "--ruler-tasks", "niah_single,vt", "--tasks-file", str(qa), "--engines", "2",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["configs"] == ["dense", "certified:paper"] and rep["reference"] == "dense"

    # perplexity: every scored token was a certified row over the cached (quantized) prefix
    ppl = rep["perplexity"]["1k"]
    assert ppl["dense"]["windows"] == ppl["certified:paper"]["windows"] == 2
    assert abs(ppl["certified:paper"]["delta"]) < 0.05 * ppl["dense"]["ppl"]
    assert all(c == 896 for c in ppl["certified:paper"]["cached_tokens"])
    rows_per_window = 1024 - 896
    assert rep["rungs"]["ppl"]["certified:paper"]["head_steps"] == 2 * rows_per_window * LAYERS * HEADS
    assert rep["rungs"]["ppl"]["dense"]["head_steps"] == 0

    # generation: paired items, the certified decode steps accounted for in the rung counts
    for task in ("niah", "niah_single", "vt", "file:qa"):
        cells = rep["accuracy"][task][next(iter(rep["accuracy"][task]))]
        assert cells["dense"]["n"] == cells["certified:paper"]["n"] >= 1
        assert cells["certified:paper"]["paired"] == cells["dense"]["n"]
        assert 0.0 <= cells["certified:paper"]["acc"] <= 1.0
        assert sum(rep["rungs"][task]["certified:paper"]["rung_fraction"]) == pytest.approx(1.0)
    assert rep["accuracy"]["file:qa"]["file"]["dense"]["acc"] == 1.0  # "Paris"
    for cells in (rep["accuracy"]["niah"]["1k"], rep["ruler"]["1k"]):
        assert cells["dense"]["n"] == cells["certified:paper"]["paired"] == 2
    assert {p.name for p in out.glob("*.png")} == {"accuracy_by_context.png", "ppl_delta.png", "rungs.png"}
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]  # one engine per config
    assert sorted((r["config"], r["kind"]) for r in runs) == [("certified:paper", "ppl+gen"), ("dense", "ppl+gen")]

    # resumable: a rerun finds every item done and starts no engine
    runs_before = (out / "runs.jsonl").read_text()
    assert main(argv) == 0
    assert (out / "runs.jsonl").read_text() == runs_before
