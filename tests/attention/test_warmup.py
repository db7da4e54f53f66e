"""Startup warm-up (``certvllm.attention.warmup``): the shape classes it enumerates are the ones the glue picks,
there are few of them, and after warming them no call meets a new compile key.

CPU: the class of every (batch, length) pair is enumerated; the enumeration is at most 15 classes (14 at
LLaMA-3.1-8B shapes, 131,072 tokens, 64 sequences); ``warm_up`` on the CPU is an immediate no-op; a failure
names its class; and, under Triton's interpreter, the compile key each launch would have on a CUDA target
(Triton's own binder with the kernels' ``do_not_specialize`` lists, the kernels recorded instead of run) is,
for random batches, lengths, cache sizes and layers, always one the warm-up met. The same computation
without the opt-outs finds new keys, so the check has teeth.

GPU (``pytest -m gpu``): after ``warm_up`` at LLaMA-3.1-8B shapes, 40 calls at random batches ≤ 64 and
lengths ≤ 131,072 compile nothing; the report is printed.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import random
import re
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from certvllm.triton_kernels import jit_cache, shape_class  # noqa: E402
from certvllm.triton_kernels.common import GLUE_MAX_BLOCKS, interpreting  # noqa: E402
from certvllm.triton_kernels.shape_class import JIT_OPTIONS, width_class  # noqa: E402

from certvllm.attention import gpu  # noqa: E402
from certvllm.attention.synthetic import SyntheticLayer, table_width  # noqa: E402
from certvllm.attention.warmup import (  # noqa: E402
    MAX_CLASSES,
    WarmupError,
    run_classes,
    shape_classes,
    triton_compilations,
    warm_up,
)
from certvllm.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LLAMA = (32, 8, 128)  # H_q, H_kv, D of LLaMA-3.1-8B


@pytest.mark.parametrize("block_size_tokens", [16, 32])
@pytest.mark.parametrize("max_model_len", [131072, 100_000, 4000])
def test_every_call_falls_in_an_enumerated_class(block_size_tokens, max_model_len):
    classes = shape_classes(*LLAMA, max_model_len, 64, load_config("default"), block_size_tokens=block_size_tokens)
    by_width = {c.width: c for c in classes}
    rng = random.Random(max_model_len + block_size_tokens)
    for _ in range(500):
        longest = min(max_model_len, int(2 ** rng.uniform(0, math.log2(max_model_len) + 0.01)))
        lens = [rng.randint(1, longest) for _ in range(rng.randint(0, 63))] + [longest]
        b = table_width(max(lens), block_size_tokens)  # what the vLLM metadata builder cuts the table to
        cls = by_width.get(width_class(b))
        assert cls is not None and cls.lo <= b <= cls.hi, (b, [c.name() for c in classes])
        assert gpu._glue_kernels(gpu.DEFAULT_OPTIONS, b) == cls.width.glue
    # the classes tile the widths: consecutive, no gap
    widths = [(c.lo, c.hi) for c in classes]
    m = block_size_tokens // 16
    assert widths[0][0] == m and widths[-1][1] == table_width(max_model_len, block_size_tokens)
    assert all(a[1] + m == b[0] for a, b in zip(widths, widths[1:], strict=False))


def test_the_enumeration_is_small():
    cfg = load_config("default")
    llama = shape_classes(*LLAMA, 131072, 64, cfg)
    assert len(llama) == 14 and all(c.width.glue for c in llama)  # BP = 1, 2, …, 8192
    assert [c.width.bp for c in llama] == [2**i for i in range(14)]
    for max_len in (1, 16, 17, 131073, 10**6, 10**7):
        classes = shape_classes(*LLAMA, max_len, 1, cfg)
        assert 1 <= len(classes) <= MAX_CLASSES
        assert sum(not c.width.glue for c in classes) == (max_len > 16 * GLUE_MAX_BLOCKS)
    assert shape_classes(*LLAMA, 131072, 64, load_config("dense")) == []  # dense mode: no certified call
    with pytest.raises(ValueError, match="multiple of 16"):
        shape_classes(*LLAMA, 131072, 64, cfg, block_size_tokens=24)


def test_warm_up_on_the_cpu_returns_at_once():
    start = time.perf_counter()
    report = warm_up(*LLAMA, torch.bfloat16, 131072, 64, load_config("default"), "cpu")
    assert time.perf_counter() - start < 1.0
    assert report.device == "cpu" and report.classes == () and report.total_compilations == 0
    assert "no per-shape JIT kernels" in report.summary()


def test_a_failure_names_its_class():
    class Broken:  # a synthetic layer whose calls fail past 200 tokens
        device = torch.device("cpu")
        prefetcher = None
        direct = None
        config = load_config("default")

        def call(self, lens, layer=0, *, begin_step=False, write_through=False):
            if max(lens) > 200:
                raise RuntimeError("out of resources")

    classes = shape_classes(8, 2, 64, 1000, 4, load_config("default"))
    with pytest.raises(WarmupError, match=r"H_q=8.*block tables of 9–16 columns \(BP=16\).*out of resources"):
        run_classes(classes, 1000, "H_q=8, H_kv=2, D=64, float16", Broken)


def test_kernels_compile_into_certvllm_s_own_triton_cache(tmp_path, monkeypatch):
    """vLLM sets TRITON_CACHE_DIR to a per-config folder before the warm-up: the warm-up's calls see
    certvllm's folder instead (CERTVLLM_TRITON_CACHE), and vLLM's setting is back afterwards."""
    from certvllm import env

    seen = []

    class Recording:
        device = torch.device("cpu")
        prefetcher = None
        config = load_config("default")  # audits on: one audited call compiles their checks
        direct = object()  # the default config's pool: each class once more with a write-through pool

        def call(self, lens, layer=0, *, begin_step=False, write_through=False):
            seen.append(os.environ.get("TRITON_CACHE_DIR"))

        def gather_cached_context(self):
            seen.append(os.environ.get("TRITON_CACHE_DIR"))

        def audited_call(self, lens):
            seen.append(os.environ.get("TRITON_CACHE_DIR"))
            return 0

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "vllm-per-config"))
    monkeypatch.setenv("CERTVLLM_TRITON_CACHE", str(tmp_path / "ours"))
    env.environment.cache_clear()
    try:
        classes = shape_classes(8, 2, 64, 1000, 4, load_config("default"))
        run_classes(classes, 1000, "H_q=8, H_kv=2, D=64, float16", Recording)
    finally:
        env.environment.cache_clear()
    # per class a call and one with a write-through pool, then the gather through that pool and the audited call
    assert seen == [str(tmp_path / "ours")] * (2 * len(classes) + 2) and (tmp_path / "ours").is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "vllm-per-config")


def test_every_launched_kernel_is_counted_and_opts_out():
    launched = set()
    for path in sorted((ROOT / "triton_kernels").glob("*.py")):
        launched |= {(path.stem, n) for n in re.findall(r"\b(_\w+)\[[^\]]*\]\(", path.read_text())}
    assert launched == {(mod, n) for mod, names in jit_cache.LAUNCHED.items() for n in names}
    for name, kernel in jit_cache.kernels().items():
        opts = getattr(kernel, "kwargs", None) or vars(kernel)  # interpreted kernels keep the decorator's kwargs
        for key, value in JIT_OPTIONS.items():
            assert tuple(opts[key]) == value, name
    assert triton_compilations() == 0 or not interpreting()


# ---- compile keys under the interpreter ------------------------------------------------------------------


class CompileKeys:
    """Replaces every launched kernel's ``run`` by a recorder of the compile key the launch would have on a
    CUDA target: Triton's binder for the kernel's signature, with (``honour``) or without its opt-outs. The
    kernels do not run: the calls' outputs are garbage, which the CUDA path never reads on the host."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        jit = pytest.importorskip("triton.runtime.jit")
        nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
        if not hasattr(jit, "create_function_from_signature") or not hasattr(jit, "KernelParam"):
            pytest.skip("this Triton has no binder to compute compile keys with")
        self.keys: dict[bool, set] = {True: set(), False: set()}
        for name, kernel in jit_cache.kernels().items():
            if not hasattr(kernel, "kwargs"):  # Gluon kernels do not run under the interpreter
                continue
            binders = {h: self._binder(jit, nvidia.CUDABackend, kernel, h) for h in (True, False)}
            monkeypatch.setattr(kernel, "run", self._recorder(name, binders))

    @staticmethod
    def _binder(jit, backend, kernel, honour: bool):
        sig = inspect.signature(kernel.fn)
        dns = tuple(kernel.kwargs["do_not_specialize"]) if honour else ()
        dna = tuple(kernel.kwargs["do_not_specialize_on_alignment"]) if honour else ()
        params = [jit.KernelParam(i, p, p.name in dns, p.name in dna) for i, p in enumerate(sig.parameters.values())]
        return jit.create_function_from_signature(sig, params, backend)

    def _recorder(self, name: str, binders: dict):
        def run(*args, grid, warmup, **kwargs):
            for honour, bind in binders.items():
                _, spec, options = bind(*args, **kwargs)
                self.keys[honour].add((name, str(spec), str(sorted(options.items()))))

        return run

    def snapshot(self) -> dict[bool, set]:
        return {h: set(k) for h, k in self.keys.items()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the recorder replaces interpreted kernels")
@pytest.mark.parametrize(
    "preset,overrides,glue_max,block_size_tokens",
    [
        ("default", {"cuda_graphs": False}, GLUE_MAX_BLOCKS, 16),  # eager calls: the step prefetch's kernels too
        ("paper", {}, 32, 16),  # exploration draws; tables past 32 columns take the torch glue
        ("naive", {"promotion_cache_fraction": 0.0}, GLUE_MAX_BLOCKS, 32),  # no pool, no prefetch; 32-token blocks
    ],
)
def test_no_new_compile_key_after_warm_up(monkeypatch, preset, overrides, glue_max, block_size_tokens):
    monkeypatch.setattr(shape_class, "GLUE_MAX_BLOCKS", glue_max)
    keys = CompileKeys(monkeypatch)
    cfg = load_config(preset, **overrides)
    hq, hkv, d, max_len = 8, 2, 64, 2000
    classes = shape_classes(hq, hkv, d, max_len, 8, cfg, block_size_tokens=block_size_tokens)
    assert any(not c.width.glue for c in classes) == (glue_max < 125)
    make = functools.partial(SyntheticLayer, hq, hkv, d, torch.float16, cfg, "cpu", block_size_tokens=block_size_tokens)
    run_classes(classes, max_len, "test", make)
    warm = keys.snapshot()
    # another cache (37 blocks: odd pool and staging sizes), two layers (the second ring slot), random batches
    layer = SyntheticLayer(hq, hkv, d, torch.float16, cfg, "cpu", block_size_tokens=block_size_tokens, blocks=37,
                           layers=2, seed=3)  # fmt: skip
    rng = random.Random(7)
    for _ in range(16):
        longest = min(max_len, int(2 ** rng.uniform(0, math.log2(max_len))))
        lens = [rng.randint(1, longest) for _ in range(rng.randint(0, 7))] + [longest]
        for i in range(2):
            layer.call(lens, i, begin_step=i == 0 and rng.random() < 0.7)
        if cfg.audit_rate > 0 and rng.random() < 0.3:  # the audit's device checks (outputs are garbage here: unread)
            layer.audited_call(lens)
        if layer.direct is not None and rng.random() < 0.3:  # an exact prefill's cached context through the pool
            layer.gather_cached_context()
    assert (layer.direct is not None) == (cfg.promotion_cache_fraction > 0)  # naive: no pool
    new = keys.keys[True] - warm[True]
    assert not new, sorted({n for n, *_ in new})
    assert keys.keys[False] - warm[False]  # with Triton's default specialisation the same calls compile more


# ---- the GPU --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_compilation_after_warm_up_at_llama_shapes():
    cfg = load_config("default")
    max_len, max_seqs = 131072, 64
    report = warm_up(*LLAMA, torch.bfloat16, max_len, max_seqs, cfg, "cuda")
    print(report.summary())
    print("\n".join(report.lines()))
    assert len(report.classes) == 14 and report.total_seconds > 0
    # another cache than warm-up's (97 blocks), two layers sharing the step prefetch, as a served model's
    layer = SyntheticLayer(*LLAMA, torch.bfloat16, cfg, "cuda", blocks=97, layers=2, seed=1)
    before = jit_cache.variants_by_kernel()
    rng = random.Random(2026)
    edges = [1, 16, 17, 256, 257, 4096, 65536, 65537, max_len]
    for step in range(20):
        longest = edges[step] if step < len(edges) else min(max_len, int(2 ** rng.uniform(0, 17)))
        lens = [rng.randint(1, longest) for _ in range(rng.randint(0, max_seqs - 1))] + [longest]
        for i in range(2):  # 40 calls
            layer.call(lens, i, begin_step=i == 0)
        if step % 4 == 0:  # the audit's device checks, at this step's longest row (a table as wide as it)
            assert layer.audited_call([longest]) == 0
        if step % 5 == 0:  # an exact prefill's cached context through the write-through pool
            layer.gather_cached_context()
    torch.cuda.synchronize()
    after = jit_cache.variants_by_kernel()
    assert after == before, {k: after[k] - before[k] for k in after if after[k] != before[k]}
