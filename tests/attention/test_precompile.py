"""The warm-up's parallel compile (``certvllm.attention.precompile``): how many children, how the classes are
shared, and that children run the warm-up's calls and report back, or fail without failing the warm-up.

CPU: the children run the CUDA path's calls under Triton's interpreter (nothing is compiled there, so they
report 0 compilations); a child that cannot start its device, or outlives the deadline, ends up in the report's
note. GPU (``pytest -m gpu``): at LLaMA-3.1-8B shapes the serial pass after the children compiles nothing new,
and the warm-up as a whole takes less time than the serial one did.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (the children inherit it)
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from certvllm.attention import precompile as pc  # noqa: E402
from certvllm.attention.precompile import LayerSpec, partition, plan_workers, precompile  # noqa: E402
from certvllm.attention.warmup import WarmupReport, shape_classes  # noqa: E402
from certvllm.config import load_config  # noqa: E402


def test_partition_balances_and_keeps_every_class_once():
    costs = [4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1]
    groups = partition(costs, 4)
    assert sorted(i for g in groups for i in g) == list(range(len(costs)))
    assert all(groups)
    totals = sorted(sum(costs[i] for i in g) for g in groups)
    assert totals[-1] == 4096  # the widest class alone; the others share the rest
    assert groups == partition(costs, 4)  # deterministic
    assert partition([5, 5, 5], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="1 ≤ n ≤ 3"):
        partition([1, 2, 3], 4)


def test_plan_workers(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(pc, "_cpus", lambda: 16)
    assert plan_workers(load_config("default"), 13, cpu) == 8  # one per two CPUs, at most 8
    assert plan_workers(load_config("default"), 5, cpu) == 5  # no more than the classes
    assert plan_workers(load_config("default", warmup_workers=3), 13, cpu) == 3
    assert plan_workers(load_config("default", warmup_workers=1), 13, cpu) == 0  # serial
    assert plan_workers(load_config("default", warmup_workers=0), 13, cpu) == 0
    monkeypatch.setattr(pc, "_cpus", lambda: 2)
    assert plan_workers(load_config("default"), 13, cpu) == 0  # one child would only add its start-up
    monkeypatch.setattr(pc, "_cpus", lambda: 16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * 2**30, 80 * 2**30))
    assert plan_workers(load_config("default"), 13, torch.device("cuda", 0)) == 2  # 2 GiB each
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**30, 80 * 2**30))
    assert plan_workers(load_config("default"), 13, torch.device("cuda", 0)) == 0


def _spec(device: str, **config) -> tuple[LayerSpec, list[int]]:
    cfg = load_config("default", **config)
    hq, hkv, d, max_len = 4, 2, 64, 40  # three classes: 1, 2 and 3 columns
    classes = shape_classes(hq, hkv, d, max_len, 4, cfg)
    spec = LayerSpec(hq, hkv, d, "float16", max_len, 4, cfg.model_dump(mode="json"), device, 16, None)
    return spec, [max(c.width.bp, c.hi) for c in classes]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run; the GPU's is below")
def test_children_run_the_warm_up_calls_of_their_classes():
    spec, costs = _spec("cpu")
    assert len(costs) == 3
    report = precompile(spec, costs, 2)
    assert report.workers == 2 and report.note == "", report.note
    assert report.compilations == 0  # the interpreter compiles nothing
    assert report.variants == frozenset() and report.backend == ""  # no GPU backend under the interpreter
    assert "2 processes compiled 0 variants" in report.summary()


def test_a_failing_child_is_reported_not_raised():
    spec, costs = _spec("cuda:97")  # no such device anywhere: each child fails at startup
    report = precompile(spec, costs, 2)
    assert report.workers == 2 and report.note.startswith("2 of 2 failed"), report.note
    assert "process 0:" in report.note and "process 1:" in report.note


def test_children_past_the_deadline_are_killed():
    spec, costs = _spec("cpu")
    start = time.perf_counter()
    report = precompile(spec, costs, 2, timeout=0.5)
    assert "killed after" in report.note
    assert time.perf_counter() - start < 30


def test_the_warm_up_line_names_the_parallel_compile():
    spec, costs = _spec("cpu")
    classes = shape_classes(4, 2, 64, 40, 4, load_config("default"))
    report = WarmupReport("cuda:0", tuple(classes), tuple(0.1 for _ in classes), tuple(2 for _ in classes), 31.0,
                          2 * len(classes), precompile=pc.PrecompileReport(8, 30.0, 107))  # fmt: skip
    line = report.summary()
    assert "8 processes compiled 107 variants in 30.0 s, then slowest class of the serial pass" in line
    assert "compiled in 31.0 s" in line


def test_serial_misses_names_what_the_children_did_not_leave():
    kid = frozenset({("phase2._promote_kernel", "(('*fp32', 'D'), 16)[num_warps=4]", "aa11"),
                     ("select._select_kernel", "(('i64', ''), 4096)[num_warps=8]", "bb22")})  # fmt: skip
    assert pc.serial_misses(set(kid), kid) == ""  # every variant loaded from the children's cache
    assert pc.serial_misses(set(), kid) == ""
    # the same specialisation under another hash: the processes compile different code
    rehashed = {("phase2._promote_kernel", "(('*fp32', 'D'), 16)[num_warps=4]", "cc33")}
    text = pc.serial_misses(rehashed, kid)
    assert text.startswith("1 of 1 variants were compiled again after the children")
    assert "the same key under hash cc33 here, aa11 in a child" in text
    # another specialisation: the nearest child key and where they part
    other = {("select._select_kernel", "(('i64', ''), 4096)[num_warps=4]", "dd44")}
    text = pc.serial_misses(other, kid, "backend 13.0-90", "backend 13.0-90")
    assert "select._select_kernel: keys differ at character" in text
    assert "num_warps=4" in text and "num_warps=8" in text
    assert "differs" not in text  # the same compiler in both
    unknown = {("encode._encode_pages_kernel", "()", "ee55")}
    assert "encode._encode_pages_kernel: no child compiled this kernel" in pc.serial_misses(unknown, kid)
    here, there = "backend 13.0-90 TRITON_PTXAS_PATH=/torch/bin/ptxas", "backend 12.8-90"
    text = pc.serial_misses(rehashed, kid, here, there)
    assert f"Triton's compiler differs: {here} here, {there} in the children" in text
    assert "differs" not in pc.serial_misses(rehashed, kid, here, here)


def _torch_ptxas() -> str | None:
    """torch's own ``ptxas`` (what inductor points ``TRITON_PTXAS_PATH`` at), where the wheel ships one."""
    path = os.path.join(os.path.dirname(torch.__file__), "bin", "ptxas")
    return path if os.path.isfile(path) else None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ptxas_set_later", [False, True])
def test_children_compile_what_the_serial_pass_then_loads(tmp_path, monkeypatch, ptxas_set_later):
    """At LLaMA-3.1-8B shapes up to 8K tokens, into an empty cache: four children compile the warm-up's variants,
    and the serial pass that follows in this process adds nothing to the cache (it loaded every variant).
    ``ptxas_set_later``: as inside vLLM, this process's Triton has read its ``ptxas`` version before
    ``TRITON_PTXAS_PATH`` is pointed at torch's ``ptxas`` (another version); the children must still compile under
    this process's hashes (``precompile.children_ptxas``)."""
    from certvllm.triton_kernels import jit_cache

    from certvllm import env
    from certvllm.attention.synthetic import SyntheticLayer
    from certvllm.attention.warmup import run_classes

    monkeypatch.setenv("CERTVLLM_TRITON_CACHE", str(tmp_path / "triton"))
    if ptxas_set_later:
        here = jit_cache.backend_hash()  # this process's ptxas version, read now and kept
        other = _torch_ptxas()
        if other is None or pc._tool_version(other) in here:
            pytest.skip("torch ships no ptxas of another version than Triton's: nothing to misalign")
        monkeypatch.setenv("TRITON_PTXAS_PATH", other)
        assert pc.children_ptxas() not in (None, other)
    env.environment.cache_clear()
    try:
        cfg = load_config("default")
        hq, hkv, d, max_len = 32, 8, 128, 8192
        classes = shape_classes(hq, hkv, d, max_len, 16, cfg)
        spec = LayerSpec(hq, hkv, d, "bfloat16", max_len, 16, cfg.model_dump(mode="json"), "cuda:0", 16, None)
        with env.triton_cache_scope() as folder:
            report = precompile(spec, [max(c.width.bp, c.hi) for c in classes], 4)
            print(report.summary())
            assert report.note == "" and report.compilations > 0, report.summary()
            assert report.variants, "the children list the variants they compiled"
            assert report.backend.startswith(f"backend {jit_cache.backend_hash()}"), (
                report.backend,
                pc.compiler_fingerprint(),
            )
            if not ptxas_set_later:  # the children's fingerprint names the ptxas they were given (not in the hash)
                with monkeypatch.context() as given:
                    if (ptxas := pc.children_ptxas()) is not None:
                        given.setenv("TRITON_PTXAS_PATH", ptxas)
                    assert report.backend == pc.compiler_fingerprint()
            before = set(folder.iterdir())
        mine = jit_cache.variant_keys()
        serial = run_classes(classes, max_len, "LLaMA", lambda: SyntheticLayer(hq, hkv, d, torch.bfloat16, cfg, "cuda"))
        print(serial.summary())
        assert pc.serial_misses(jit_cache.variant_keys() - mine, report.variants) == ""
        assert set(folder.iterdir()) == before, "the serial pass compiled variants the children had not"
    finally:
        env.environment.cache_clear()


def test_the_children_get_the_ptxas_whose_version_this_process_hashes(tmp_path):
    """``matching_tool``: of the candidates (``TRITON_PTXAS_PATH``, then Triton's bundled ``ptxas``) the first
    existing file whose version is the one this process's compile hashes hold; none when nothing matches."""
    torch_ptxas, bundled = tmp_path / "torch-ptxas", tmp_path / "bundled-ptxas"
    for path in (torch_ptxas, bundled):
        path.write_text("")
    versions = {str(torch_ptxas): "release 13.0", str(bundled): "release 12.8"}
    read = versions.get
    assert pc.matching_tool("release 12.8", [str(torch_ptxas), str(bundled)], read) == str(bundled)
    assert pc.matching_tool("release 13.0", [str(torch_ptxas), str(bundled)], read) == str(torch_ptxas)
    assert pc.matching_tool("release 13.0", [None, str(bundled)], read) is None
    assert pc.matching_tool("release 12.8", [str(tmp_path / "missing"), str(bundled)], read) == str(bundled)


def test_children_start_with_the_matched_ptxas(monkeypatch):
    """``precompile`` starts its children with ``TRITON_PTXAS_PATH`` set to :func:`children_ptxas`'s answer (inside
    vLLM the server's hashes name Triton's bundled ``ptxas`` while the variable, set later by inductor, names
    torch's); with no answer they inherit the environment as it is."""
    started: list[dict | None] = []

    class Recorded:
        def __init__(self, *args, env=None, **kwargs) -> None:
            started.append(env)
            self.returncode = 1

        def wait(self, timeout=None) -> int:
            return 1

    monkeypatch.setattr(pc.subprocess, "Popen", Recorded)
    spec, costs = _spec("cpu")
    monkeypatch.setattr(pc, "children_ptxas", lambda: "/opt/triton/bin/ptxas")
    precompile(spec, costs, 2)
    assert [env["TRITON_PTXAS_PATH"] for env in started] == ["/opt/triton/bin/ptxas"] * 2
    assert all(env["PATH"] == os.environ["PATH"] for env in started)  # the rest of the environment is inherited
    started.clear()
    monkeypatch.setattr(pc, "children_ptxas", lambda: None)
    precompile(spec, costs, 2)
    assert started == [None, None]
