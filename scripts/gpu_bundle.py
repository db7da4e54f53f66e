"""Build an offline GPU bundle: the wheels that certvllm + one vLLM release need on a target without a registry.

    python scripts/gpu_bundle.py --vllm 0.26.0 --python 3.12 --platform manylinux_2_31_x86_64 \\
        --target-has deploy/targets/h200.txt                    # -> .bundle/h200-vllm0.26.0/

What it does, in order (docs/deployment.md, "Offline GPU bundle", is the operator's guide):

1. **Resolve.** The roots are ``vllm==VERSION``, the runtime dependencies in this repository's
   ``pyproject.toml`` and any ``--require``. pip's resolver cannot be told "the target already has torch",
   and vLLM pins torch exactly, so the graph is walked here: each distribution's ``Requires-Dist`` is read
   from pip's own choice (``pip install --dry-run --report --no-deps`` for the target's Python, platform
   tags and ABIs), markers are evaluated for the *target* interpreter with ``packaging``, and a requirement
   is not followed when the target provides it (``--target-has``, when its version fits), when it is on
   the exclude list (heavy optional kernels vLLM does not import at engine start, ``DEFAULT_EXCLUDES``),
   or, for torch and triton, never silently carried (``NEVER_CARRY``). Constraints from every requirer are
   intersected; the walk repeats until every chosen version satisfies them (a fixed point). The choice is
   written to ``requirements.lock`` (``name==version --hash=sha256:...``); ``--lock`` replays one.
2. **Download** the chosen wheels with ``pip download --no-deps`` into a cache (default ``.bundle/downloads``)
   and check each against the sha256 pip reported.
3. **Build** the certvllm wheel from the working tree (tracked + untracked-not-ignored files, copied to a
   temporary folder, ``pip wheel --no-deps``).
4. **Strip** named wheels with data-driven rules (``STRIP_RULES``: for vLLM the FlashAttention-2 ``.so``,
   the ``vllm-rs`` binary, the DeepGEMM ``.so`` of other Python versions), rewriting ``RECORD``
   (``sha256=<urlsafe base64, no padding>,<size>``) and the zip deterministically: sorted entries,
   ``.dist-info`` last, fixed 1980-01-01 timestamps, modes 0644/0755, no extra fields, compressed bytes of
   kept entries copied unchanged. The certvllm wheel goes through the same rewrite (no rules).
5. **Pack** one uncompressed tar (``manifest.json`` + ``wheels/*.whl``; sorted, mtime 0, uid/gid 0, mode 0644,
   PAX format) streamed into ``part-000``, ``part-001``, ... of at most ``--part-mib`` (52) MiB each, and write
   ``SHA256SUMS`` (parts, ``bundle.tar``, ``install.sh``, ``manifest.json``), ``manifest.json`` (the tar's
   copy) and ``install.sh`` (verifies, reassembles, extracts and ``pip install --no-index --no-deps
   --target`` on the target; parts may arrive in several runs).

Same inputs (lock, target file, working tree, cached wheels) give byte-identical parts, manifest and sums:
nothing written holds a timestamp, a host name or an absolute path of this machine.
"""

from __future__ import annotations

import argparse
import base64
import csv
import dataclasses
import fnmatch
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.parse
import zipfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
FORMAT = "certvllm-gpu-bundle/1"
MIB = 1 << 20
DEFAULT_PART_MIB = 52  # a lent-machine run carries <= 64 MiB: one part + the repository (6 MiB, growing) + install.sh
TAR_NAME = "bundle.tar"
SOURCE_DATE_EPOCH = 315532800  # 1980-01-01T00:00:00Z: the zip format's first representable instant

# Distributions never carried although something in the graph asks for them: heavy optional kernels and
# media stacks that vLLM 0.26 does not import at engine start (seen on the H200: vLLM starts and serves
# without them; /work/shared/reference/vllm-on-h200.md). A model that needs one must be served elsewhere
# or the exclusion lifted with --include NAME.
DEFAULT_EXCLUDES: dict[str, str] = {
    "torchvision": "image models only; a CUDA torchvision must match the target's torch build exactly",
    "torchaudio": "audio models only; must match the target's torch build exactly",
    "torchcodec": "video/audio decoding for multimodal inputs; not imported at engine start",
    "pynvvideocodec": "NVIDIA video decoding for multimodal inputs; not imported at engine start",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (Blackwell paths, several hundred MiB); not needed on Hopper",
    "tilelang": "TileLang kernels (sparse/MLA paths); not imported at engine start",
    "quack-kernels": "CuTe DSL kernels built on nvidia-cutlass-dsl; not imported at engine start",
    "tokenspeed-mla": "MLA kernels for DeepSeek-style models; not imported at engine start",
    "humming-kernels": "optional kernels built on nvidia-cutlass-dsl; not imported at engine start",
    "fastsafetensors": "GPU-direct weight loading (load_format=fastsafetensors only)",
}

# Imports a package makes at run time without declaring them in Requires-Dist: when the key is carried, the
# requirements are carried too (requirer shown as "NAME==VERSION (undeclared)").
IMPLICIT_REQUIRES: dict[str, tuple[str, ...]] = {
    # tvm_ffi.load_torch_c_dlpack_extension() imports torch_c_dlpack_ext when torch is present; vLLM 0.26's
    # engine start (xgrammar, flashinfer) failed on the H200 without it.
    "apache-tvm-ffi": ("torch-c-dlpack-ext",),
}

# Distributions that must come from the target: carrying another build is ~1 GiB or more with its CUDA
# libraries and breaks every extension compiled against the target's. A requirement the target's version
# does not satisfy is an error; --allow-carry NAME overrides it.
NEVER_CARRY: dict[str, str] = {
    "torch": "choose a vLLM release whose torch pin matches the target's torch (0.20.0-0.26.0 pin 2.11.0)",
    "triton": "triton is torch's: it must be the version the target's torch was built with",
}


@dataclasses.dataclass(frozen=True)
class StripRule:
    """Remove from wheel ``dist`` every archive path matching ``pattern`` unless it matches ``keep``.

    Both are ``fnmatch`` globs over archive paths (``*`` also crosses ``/``); ``{py}`` stands for the target's
    CPython tag digits (``312`` for Python 3.12).
    """

    dist: str
    pattern: str
    why: str
    keep: str = ""

    def matches(self, path: str, py: str) -> bool:
        """Whether ``path`` is removed for a target whose CPython tag digits are ``py``."""
        if not fnmatch.fnmatchcase(path, self.pattern.format(py=py)):
            return False
        return not (self.keep and fnmatch.fnmatchcase(path, self.keep.format(py=py)))


STRIP_RULES: tuple[StripRule, ...] = (
    StripRule(
        "vllm",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "FlashAttention-2 kernels (290 MiB, 123.5 MiB compressed); Hopper runs FA3 (_vllm_fa3_C), which stays",
    ),
    StripRule("vllm", "vllm/vllm-rs", "the Rust frontend binary, run only with VLLM_USE_RUST_FRONTEND=1"),
    StripRule(
        "vllm",
        "vllm/third_party/deep_gemm/_C.cpython-*.so",
        "DeepGEMM extensions built for other Python versions",
        keep="vllm/third_party/deep_gemm/_C.cpython-{py}-*.so",
    ),
)


class BundleError(RuntimeError):
    """A bundle cannot be built as asked; the message names the value, what is allowed and the fix."""


def log(msg: str) -> None:
    """Progress on stderr (stdout stays free for the final summary)."""
    print(f"gpu_bundle: {msg}", file=sys.stderr, flush=True)


def b64_digest(digest: bytes) -> str:
    """The wheel spec's hash encoding: urlsafe base64 without ``=`` padding."""
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MIB):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------
# The target


_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_([a-z0-9_]+)$")
_LEGACY = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}


def expand_platform(tag: str) -> tuple[str, ...]:
    """All manylinux tags a target with glibc ``2.N`` accepts, newest first, for pip's ``--platform``.

    ``manylinux_2_31_x86_64`` -> ``manylinux_2_31_x86_64, ..., manylinux_2_17_x86_64, manylinux2014_x86_64, ...,
    manylinux1_x86_64``. pip does not expand a given ``--platform`` itself (a ``manylinux_2_17`` wheel is not
    found for ``--platform manylinux_2_31_x86_64`` alone).
    """
    for legacy, minor in _LEGACY.items():
        if tag.startswith(legacy + "_"):
            tag = f"manylinux_2_{minor}_{tag[len(legacy) + 1 :]}"
    m = _MANYLINUX.match(tag)
    if not m or m.group(1) != "2" or int(m.group(2)) < 5:
        raise BundleError(
            f"--platform {tag!r}: expected manylinux_2_N_ARCH with N >= 5 (the target's glibc 2.N, `ldd --version` "
            "on the target), e.g. manylinux_2_31_x86_64; GPU targets are Linux, other platforms are not supported"
        )
    minor, arch = int(m.group(2)), m.group(3)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(minor, 4, -1)]
    tags += [f"{legacy}_{arch}" for legacy, n in _LEGACY.items() if n <= minor]
    return tuple(tags)


@dataclasses.dataclass(frozen=True)
class Target:
    """The interpreter and platform the bundle is for (not this machine's).

    ``python`` is ``X.Y`` or ``X.Y.Z``; ``platform`` the highest manylinux tag the target accepts.
    """

    python: str
    platform: str

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d+(\.\d+)?", self.python):
            raise BundleError(f"--python {self.python!r}: expected 3.Y or 3.Y.Z (the target's `python3 -V`), e.g. 3.12")
        expand_platform(self.platform)

    @property
    def py(self) -> str:
        """CPython tag digits: ``312`` for 3.12."""
        return "".join(self.python.split(".")[:2])

    @property
    def platforms(self) -> tuple[str, ...]:
        return expand_platform(self.platform)

    @property
    def machine(self) -> str:
        return _MANYLINUX.match(self.platforms[0]).group(3)  # type: ignore[union-attr]

    @property
    def abis(self) -> tuple[str, ...]:
        return (f"cp{self.py}", "abi3", "none")

    def marker_env(self) -> dict[str, str]:
        """PEP 508 marker variables of the target interpreter (``extra`` is added per evaluation)."""
        full = self.python if self.python.count(".") == 2 else self.python + ".0"
        return {
            "implementation_name": "cpython",
            "implementation_version": full,
            "os_name": "posix",
            "platform_machine": self.machine,
            "platform_python_implementation": "CPython",
            "platform_release": "",
            "platform_system": "Linux",
            "platform_version": "",
            "python_full_version": full,
            "python_version": ".".join(self.python.split(".")[:2]),
            "sys_platform": "linux",
        }

    def pip_args(self) -> list[str]:
        """pip's cross-target options: binary wheels only, for this Python, these platform tags and ABIs."""
        args = ["--only-binary=:all:", "--python-version", self.python, "--implementation", "cp"]
        for p in self.platforms:
            args += ["--platform", p]
        for a in self.abis:
            args += ["--abi", a]
        return args


def read_target_has(path: Path) -> dict[str, Version | None]:
    """Parse a target-has file: one ``name==version`` or bare ``name`` (present, any version) per line.

    ``#`` starts a comment. The output of ``pip list --format=freeze`` on the target is a valid file;
    ``name @ url`` lines count as bare names. Returns canonical name -> version (``None``: unknown).
    """
    if not path.is_file():
        raise BundleError(f"--target-has {path}: no such file; write one `name==version` per line (deploy/targets/)")
    have: dict[str, Version | None] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        if " @ " in line:
            name, version = line.split(" @ ", 1)[0], ""
        name = name.strip()
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise BundleError(
                f"{path}:{lineno}: {raw.strip()!r} is not `name==version` or `name`; fix the line "
                "(pip list --format=freeze on the target writes this format)"
            )
        try:
            have[canonicalize_name(name)] = Version(version.strip()) if version.strip() else None
        except InvalidVersion as exc:
            raise BundleError(f"{path}:{lineno}: version {version.strip()!r} is not a PEP 440 version") from exc
    return have


def read_project(root: Path) -> tuple[str, str, list[str]]:
    """(name, version, runtime requirements) from ``root/pyproject.toml``'s ``[project]`` table."""
    meta = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return meta["name"], meta["version"], list(meta.get("dependencies", []))


# ---------------------------------------------------------------------------------------------------
# Resolution


@dataclasses.dataclass(frozen=True)
class Pick:
    """One wheel chosen for a distribution: what pip reported for it (metadata of that exact file)."""

    name: str  # canonical
    version: str
    filename: str
    url: str
    sha256: str  # hex; "" when the index gave none (then checked after download only)
    requires_dist: tuple[str, ...]


@dataclasses.dataclass
class Node:
    """A distribution the bundle carries: the intersection of what asks for it, and who asks."""

    name: str
    specifier: SpecifierSet = dataclasses.field(default_factory=SpecifierSet)
    extras: set[str] = dataclasses.field(default_factory=set)
    required_by: set[str] = dataclasses.field(default_factory=set)
    asks: dict[str, SpecifierSet] = dataclasses.field(default_factory=dict)  # requirer -> its specifier


@dataclasses.dataclass
class Graph:
    """One walk of the requirement graph over the picks known so far."""

    nodes: dict[str, Node] = dataclasses.field(default_factory=dict)
    provided: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # name -> "requirer: requirement"
    excluded: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    outdated: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # target has it, too old/new: carried
    conflicts: list[str] = dataclasses.field(default_factory=list)


def _applies(req: Requirement, env: dict[str, str], extras: Iterable[str]) -> bool:
    """Whether ``req`` applies on the target for a distribution installed with ``extras``."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in ("", *sorted(extras)))


def walk(
    roots: Sequence[tuple[str, str]],
    picks: dict[str, Pick],
    env: dict[str, str],
    target_has: dict[str, Version | None],
    excludes: dict[str, str],
    allow_carry: AbstractSet[str] = frozenset(),
    implicit: dict[str, tuple[str, ...]] = IMPLICIT_REQUIRES,
    carry: AbstractSet[str] = frozenset(),
) -> Graph:
    """Walk from ``roots`` ((requirer, requirement string)) through the ``Requires-Dist`` of ``picks``.

    A distribution without a pick is a leaf of this walk (resolved in the next round). Target-provided
    names whose version fits (or is unknown), excluded names and requirements whose markers are false on
    the target are not followed. ``implicit`` adds undeclared run-time requirements of carried names.
    A target-provided name that some requirement does not accept is carried (``outdated``); ``carry``
    (the outdated names of an earlier walk) makes every requirer of such a name constrain the carried one.
    """
    g = Graph()
    queue = [(who, req) for who, req in ((w, Requirement(r)) for w, r in roots) if _applies(req, env, ())]
    expanded: dict[str, set[str]] = {}  # name -> extras its dependencies were expanded with
    while queue:
        who, req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in excludes:
            g.excluded.setdefault(name, set()).add(who)
            continue
        if name in target_has:
            have = target_has[name]
            if have is not None and not req.specifier.contains(have, prereleases=True):
                if name in NEVER_CARRY and name not in allow_carry:
                    g.conflicts.append(
                        f"{who} needs {req} but the target has {name} {have}: {NEVER_CARRY[name]}, "
                        f"or pass --allow-carry {name} to carry it anyway"
                    )
                    continue
                g.outdated.setdefault(name, set()).add(f"{who}: {req} (target has {have})")
            elif name not in carry and name not in g.outdated:
                g.provided.setdefault(name, set()).add(f"{who}: {req}")
                continue
        node = g.nodes.setdefault(name, Node(name))
        node.specifier &= req.specifier
        node.extras |= set(req.extras)
        node.required_by.add(who)
        node.asks[who] = node.asks.get(who, SpecifierSet()) & req.specifier
        pick = picks.get(name)
        if pick is None or not node.specifier.contains(Version(pick.version), prereleases=True):
            continue
        if name in expanded and node.extras <= expanded[name]:
            continue
        expanded[name] = set(node.extras)
        for dep in pick.requires_dist:
            try:
                dreq = Requirement(dep)
            except InvalidRequirement as exc:
                raise BundleError(f"{pick.filename}: Requires-Dist {dep!r} is not PEP 508: {exc}") from exc
            if _applies(dreq, env, node.extras):
                queue.append((f"{name}=={pick.version}", dreq))
        for dep in implicit.get(name, ()):
            queue.append((f"{name}=={pick.version} (undeclared)", Requirement(dep)))
    return g


PickFn = Callable[[list[str]], dict[str, Pick]]


class NoMatch(BundleError):
    """pip found no wheel for ``requirement``; ``available`` are the versions it did find for the target."""

    def __init__(self, requirement: str, available: list[str] | None, message: str) -> None:
        super().__init__(message)
        self.requirement, self.available = requirement, available


def _culprits(node: Node, available: Sequence[str], picks: dict[str, Pick], pinned: AbstractSet[str]) -> list[str]:
    """Requirers of ``node`` to ban so that some version in ``available`` meets the remaining constraints.

    Requirers that cannot be picked again (roots, and picks a root pins with ``==``: ``pinned``) are kept;
    the others are kept in sorted order while the kept constraints still leave a version, and blamed when
    they would not (greedy, deterministic). Returns ``[]`` when even the kept-for-sure constraints conflict.
    """
    versions = [Version(v) for v in available]

    def fits(spec: SpecifierSet) -> bool:
        return any(spec.contains(v, prereleases=True) for v in versions)

    kept, movable = SpecifierSet(), []
    for who, spec in sorted(node.asks.items()):
        name, _, version = who.partition("==")
        if name in picks and picks[name].version == version and name not in pinned:
            movable.append((who, spec))
        else:
            kept &= spec
    if not fits(kept):
        return []
    blamed = []
    for who, spec in movable:
        if fits(kept & spec):
            kept &= spec
        else:
            blamed.append(who)
    return blamed


def resolve(
    roots: Sequence[tuple[str, str]],
    pick: PickFn,
    env: dict[str, str],
    target_has: dict[str, Version | None],
    excludes: dict[str, str],
    allow_carry: AbstractSet[str] = frozenset(),
    lock: dict[str, str] | None = None,
    max_rounds: int = 120,
    implicit: dict[str, tuple[str, ...]] = IMPLICIT_REQUIRES,
) -> tuple[Graph, dict[str, Pick]]:
    """Walk, pick what is missing or no longer fits, repeat until every pick satisfies its constraints.

    ``pick`` maps requirement strings (``name<specifier>``) to picks and raises ``NoMatch`` when one has no
    wheel. Then the requirer whose constraint alone causes it has its version banned (``!=``) and is picked
    again: a one-step backtrack, enough for the common case of a newest release needing a newer dependency
    than another package pins. ``lock`` (name -> version) replaces a requirement by ``name==locked`` when
    the locked version fits. Returns the final graph and the picks of its nodes only.
    """
    picks: dict[str, Pick] = {}
    bans: dict[str, set[str]] = {}
    carry: set[str] = set()
    pinned = {
        canonicalize_name(Requirement(r).name)
        for _, r in roots
        if any(s.operator in ("==", "===") and "*" not in s.version for s in Requirement(r).specifier)
    }
    for rnd in range(1, max_rounds + 1):
        g = walk(roots, picks, env, target_has, excludes, allow_carry, implicit, carry)
        if g.conflicts:
            raise BundleError("the target cannot take this vLLM as it is:\n  " + "\n  ".join(sorted(g.conflicts)))
        if not set(g.outdated) <= carry:
            carry |= set(g.outdated)  # walk again: requirers met before the mismatch was seen must constrain it
            continue
        need = {
            n: node
            for n, node in g.nodes.items()
            if n not in picks or not node.specifier.contains(Version(picks[n].version), prereleases=True)
        }
        if not need:
            return g, {n: picks[n] for n in sorted(g.nodes)}
        reqs = []
        for n, node in sorted(need.items()):
            spec = node.specifier & SpecifierSet(",".join(f"!={v}" for v in sorted(bans.get(n, ()))))
            locked = (lock or {}).get(n)
            if locked is not None and spec.contains(Version(locked), prereleases=True):
                reqs.append(f"{n}=={locked}")
            else:
                reqs.append(f"{n}{spec}")
        log(f"round {rnd}: picking {len(reqs)} distribution(s)")
        try:
            got = pick(reqs)
        except NoMatch as exc:
            name = canonicalize_name(Requirement(exc.requirement).name)
            node = g.nodes.get(name)
            blamed = _culprits(node, exc.available, picks, pinned) if node and exc.available else []
            if not blamed:
                asks = "; ".join(f"{w}: {s or 'any'}" for w, s in sorted(node.asks.items())) if node else "?"
                raise BundleError(f"{exc}\nwho asks for {name}: {asks}") from exc
            for who in blamed:
                bad, _, version = who.partition("==")
                log(f"backtrack: {who} asks {name}{node.asks[who]}, which conflicts; trying another {bad}")
                bans.setdefault(bad, set()).add(version)
                del picks[bad]
            continue
        for n in need:
            if n not in got:
                raise BundleError(f"pip chose nothing for {n} (asked for {reqs}); rerun with -v to see pip's output")
        picks.update(got)
    raise BundleError(f"the requirement walk did not settle in {max_rounds} rounds; constraints keep changing")


class PipPicker:
    """``pip install --dry-run --report --no-deps`` for the target: which wheel pip takes, and its metadata."""

    def __init__(self, target: Target, pip: Sequence[str], workdir: Path, verbose: bool = False) -> None:
        self.target, self.pip, self.workdir, self.verbose = target, list(pip), workdir, verbose
        self.requirers: dict[str, set[str]] = {}

    def __call__(self, reqs: list[str]) -> dict[str, Pick]:
        report = self.workdir / "report.json"
        cmd = [
            *self.pip,
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-deps",
            "--quiet",
            *self.target.pip_args(),
            "--target",
            str(self.workdir / "never-written"),
            "--report",
            str(report),
            *reqs,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if self.verbose:
            sys.stderr.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            m = re.search(r"satisfies the requirement (\S+)(?: \(from versions: ([^)]*)\))?", proc.stderr)
            if not m:
                hint = (
                    " (pip >= 22.2 is needed for --report: python -m pip install -U pip)"
                    if "--report" in proc.stderr
                    else ""
                )
                raise BundleError(
                    f"pip failed (rc {proc.returncode}) picking {' '.join(reqs)}{hint}:\n{proc.stderr[-3000:]}"
                )
            what, listed = m.group(1), (m.group(2) or "").strip()
            available = [v.strip() for v in listed.split(",")] if listed and listed != "none" else None
            shown = ", ".join((["..."] if len(available or []) > 8 else []) + (available or ["none"])[-8:])
            raise NoMatch(
                what,
                available,
                f"no wheel of {what} for CPython {self.target.python} on {self.target.platform} or older manylinux "
                f"(versions with a wheel for the target: {shown})\n"
                "Fix: raise --platform to the target's glibc (`ldd --version` on the target), add the name to the "
                "target-has file if the target has it, or --exclude it if the target never imports it",
            )
        out: dict[str, Pick] = {}
        for item in json.loads(report.read_text())["install"]:
            meta, info = item["metadata"], item["download_info"]
            url = info["url"]
            hashes = info.get("archive_info", {}).get("hashes", {})
            name = canonicalize_name(meta["name"])
            out[name] = Pick(
                name=name,
                version=meta["version"],
                filename=urllib.parse.unquote(url.rsplit("/", 1)[-1].split("#", 1)[0]),
                url=url,
                sha256=hashes.get("sha256", ""),
                requires_dist=tuple(meta.get("requires_dist", [])),
            )
        return out


def read_lock(path: Path) -> dict[str, str]:
    """name -> version from a ``requirements.lock`` this script wrote (``name==version --hash=...``)."""
    lock = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            spec = line.split()[0]
            name, sep, version = spec.partition("==")
            if not sep:
                raise BundleError(f"--lock {path}: {raw!r} is not `name==version --hash=sha256:...`")
            lock[canonicalize_name(name)] = version
    return lock


def download(picks: dict[str, Pick], target: Target, pip: Sequence[str], cache: Path, verbose: bool) -> dict[str, Path]:
    """``pip download --no-deps`` every pick into ``cache`` (a file already there is not fetched again)."""
    cache.mkdir(parents=True, exist_ok=True)
    want = [f"{p.name}=={p.version}" for p in picks.values() if not (cache / p.filename).is_file()]
    if want:
        log(f"downloading {len(want)} wheel(s) into {cache}")
        proc = subprocess.run(
            [*pip, "download", "--no-deps", "--quiet", *target.pip_args(), "--dest", str(cache), *want],
            capture_output=not verbose,
            text=True,
        )
        if proc.returncode != 0:
            raise BundleError(f"pip download failed for {' '.join(want)}:\n{(proc.stderr or '')[-3000:]}")
    paths = {}
    for p in picks.values():
        path = cache / p.filename
        if not path.is_file():
            raise BundleError(f"pip download did not write {p.filename} for {p.name}=={p.version} into {cache}")
        if p.sha256 and sha256_file(path) != p.sha256:
            raise BundleError(f"{path}: sha256 differs from the index's {p.sha256}: delete the file and rerun")
        paths[p.name] = path
    return paths


# ---------------------------------------------------------------------------------------------------
# Deterministic wheel rewriting

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile.structFileHeader
_CENTRAL_DIR = struct.Struct("<4s4B4HL2L5H2L")  # zipfile.structCentralDir
_END_RECORD = struct.Struct("<4s4H2LH")  # zipfile.structEndArchive
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01
_DOS_TIME = 0
_ZIP32_MAX = 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class Rewritten:
    """What a rewrite removed: (archive path, uncompressed size, why)."""

    removed: tuple[tuple[str, int, str], ...]


def _dist_info(names: Iterable[str], wheel: Path) -> str:
    dirs = sorted({n.split("/", 1)[0] for n in names if n.count("/") == 1 and n.endswith(".dist-info/WHEEL")})
    if len(dirs) != 1:
        raise BundleError(f"{wheel.name}: expected exactly one top-level *.dist-info/WHEEL, found {dirs or 'none'}")
    return dirs[0]


def rewrite_wheel(
    src: Path, dst: Path, remove: Callable[[str], str | None] = lambda path: None, verify: bool = True
) -> Rewritten:
    """Write ``src`` to ``dst`` without the entries ``remove`` names (it returns a reason or ``None``).

    The output is deterministic: entries sorted with ``*.dist-info/`` last and ``RECORD`` last of all,
    every timestamp 1980-01-01 00:00:00, Unix modes 0644 (0755 where any x bit was set), no extra fields,
    no directory entries; the compressed bytes of kept entries are copied as they are (no recompression).
    ``RECORD`` is rewritten from the kept entries' contents (``path,sha256=<b64url no pad>,size``; its own
    row ``RECORD,,``); ``RECORD.jws``/``RECORD.p7s`` signatures are dropped. An entry whose content
    disagrees with the original ``RECORD`` is an error (a corrupt download) unless ``verify`` is false.
    """
    with zipfile.ZipFile(src) as zf:
        infos = [i for i in zf.infolist() if not i.is_dir()]
        dist_info = _dist_info((i.filename for i in infos), src)
        record_path = f"{dist_info}/RECORD"
        old_record: dict[str, str] = {}
        if record_path in zf.namelist():
            for row in csv.reader(io.StringIO(zf.read(record_path).decode("utf-8"))):
                if row and len(row) >= 2:
                    old_record[row[0]] = row[1]
        removed: list[tuple[str, int, str]] = []
        kept: list[zipfile.ZipInfo] = []
        for info in infos:
            name = info.filename
            if name in (record_path, f"{dist_info}/RECORD.jws", f"{dist_info}/RECORD.p7s"):
                continue
            if name.startswith(dist_info + "/"):
                why = None
            else:
                why = remove(name)
            if why is not None:
                removed.append((name, info.file_size, why))
                continue
            if info.flag_bits & 0x1:
                raise BundleError(f"{src.name}: {name} is encrypted; a wheel cannot hold encrypted entries")
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise BundleError(f"{src.name}: {name} uses zip method {info.compress_type}; only stored/deflate")
            if max(info.file_size, info.compress_size) >= _ZIP32_MAX:
                raise BundleError(f"{src.name}: {name} needs ZIP64 (>= 4 GiB), which this writer does not write")
            kept.append(info)
        kept.sort(key=lambda i: (i.filename.startswith(dist_info + "/"), i.filename))
        rows = []
        for info in kept:
            h, size = hashlib.sha256(), 0
            with zf.open(info) as f:  # verifies the CRC at the end
                while chunk := f.read(MIB):
                    h.update(chunk)
                    size += len(chunk)
            digest = "sha256=" + b64_digest(h.digest())
            if verify and info.filename in old_record and old_record[info.filename] not in ("", digest):
                raise BundleError(
                    f"{src.name}: {info.filename} hashes to {digest} but RECORD says {old_record[info.filename]}: "
                    "the wheel is corrupt; delete it from the download cache and rerun"
                )
            rows.append([info.filename, digest, str(size)])
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerows(rows)
    writer.writerow([record_path, "", ""])
    record = buf.getvalue().encode("utf-8")

    tmp = dst.with_name(dst.name + ".part")
    central: list[bytes] = []
    with open(src, "rb") as fin, open(tmp, "wb") as fout:

        def entry(name: str, method: int, crc: int, csize: int, usize: int, mode: int, data: Iterable[bytes]) -> None:
            raw_name = name.encode("utf-8")
            flags = 0x800 if not name.isascii() else 0
            offset = fout.tell()
            if offset >= _ZIP32_MAX:
                raise BundleError(f"{dst.name}: over 4 GiB needs ZIP64, which this writer does not write")
            fout.write(
                _LOCAL_HEADER.pack(
                    b"PK\x03\x04", 20, 0, flags, method, _DOS_TIME, _DOS_DATE, crc, csize, usize, len(raw_name), 0
                )
            )
            fout.write(raw_name)
            for chunk in data:
                fout.write(chunk)
            central.append(
                _CENTRAL_DIR.pack(
                    b"PK\x01\x02",
                    20,
                    3,
                    20,
                    0,
                    flags,
                    method,
                    _DOS_TIME,
                    _DOS_DATE,
                    crc,
                    csize,
                    usize,
                    len(raw_name),
                    0,
                    0,
                    0,
                    0,
                    (0o100000 | mode) << 16,
                    offset,
                )  # fmt: skip
                + raw_name
            )

        def raw_bytes(info: zipfile.ZipInfo) -> Iterable[bytes]:
            fin.seek(info.header_offset)
            header = _LOCAL_HEADER.unpack(fin.read(_LOCAL_HEADER.size))
            if header[0] != b"PK\x03\x04":
                raise BundleError(f"{src.name}: bad local header for {info.filename}")
            fin.seek(info.header_offset + _LOCAL_HEADER.size + header[10] + header[11])
            left = info.compress_size
            while left:
                chunk = fin.read(min(left, MIB))
                if not chunk:
                    raise BundleError(f"{src.name}: truncated data for {info.filename}")
                left -= len(chunk)
                yield chunk

        for info in kept:
            mode = 0o755 if (info.external_attr >> 16) & 0o111 else 0o644
            entry(
                info.filename, info.compress_type, info.CRC, info.compress_size, info.file_size, mode, raw_bytes(info)
            )
        comp = zlib.compressobj(6, zlib.DEFLATED, -15)
        packed = comp.compress(record) + comp.flush()
        entry(record_path, zipfile.ZIP_DEFLATED, zlib.crc32(record), len(packed), len(record), 0o644, [packed])
        cd_offset = fout.tell()
        for c in central:
            fout.write(c)
        cd_size = fout.tell() - cd_offset
        if len(central) > 0xFFFF or cd_offset >= _ZIP32_MAX:
            raise BundleError(f"{dst.name}: {len(central)} entries / {cd_offset} bytes need ZIP64, not written here")
        fout.write(_END_RECORD.pack(b"PK\x05\x06", 0, 0, len(central), len(central), cd_size, cd_offset, 0))
    os.replace(tmp, dst)
    return Rewritten(tuple(sorted(removed)))


def strip_for(rules: Sequence[StripRule], dist: str, py: str) -> Callable[[str], str | None]:
    """The ``remove`` callback of ``rewrite_wheel`` for distribution ``dist`` on CPython ``py`` (e.g. 312)."""
    mine = [r for r in rules if canonicalize_name(r.dist) == dist]

    def remove(path: str) -> str | None:
        for r in mine:
            if r.matches(path, py):
                return r.why
        return None

    return remove


def build_project_wheel(root: Path, workdir: Path, pip: Sequence[str]) -> Path:
    """Build this repository's wheel (``pip wheel --no-deps``) from a copy of its working tree.

    The copy holds tracked files and untracked files git does not ignore (what ``git status`` would
    commit), so caches, virtual environments and ``.bundle/`` never reach the wheel, and the build writes
    nothing into the working tree. ``SOURCE_DATE_EPOCH`` is fixed; the caller normalizes the zip.
    """
    src, dist = workdir / "src", workdir / "dist"
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise BundleError(
            f"{root} is not a git checkout (git ls-files failed: {exc}); build the wheel yourself "
            "(pip wheel --no-deps -w DIR .) and pass --certvllm-wheel DIR/certvllm-*.whl"
        ) from exc
    for rel in sorted(set(listing.decode().split("\0")) - {""}):
        if (root / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, src / rel)
    cmd = [*pip, "wheel", "--no-deps", "--quiet", "--wheel-dir", str(dist)]
    try:
        import setuptools  # noqa: F401

        cmd.append("--no-build-isolation")  # this interpreter's setuptools: no index needed for the build
    except ImportError:
        pass
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)}
    proc = subprocess.run([*cmd, str(src)], capture_output=True, text=True, env=env)
    wheels = sorted(dist.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise BundleError(f"pip wheel of {root} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return wheels[0]


def wheel_name_version(path: Path) -> tuple[str, str]:
    """(canonical name, version) from a wheel file name ``name-version(-build)?-py-abi-plat.whl``."""
    parts = path.name[: -len(".whl")].split("-")
    if len(parts) not in (5, 6) or not path.name.endswith(".whl"):
        raise BundleError(f"{path.name}: not a wheel file name (name-version-python-abi-platform.whl)")
    return canonicalize_name(parts[0]), parts[1]


# ---------------------------------------------------------------------------------------------------
# Packing: tar -> parts, sums, install script


class PartWriter(io.RawIOBase):
    """A write-only stream that cuts what it receives into ``prefix-000``, ``-001``, ... of ``part_size``.

    Keeps the sha256 of every part and of the whole stream; ``parts`` is [(file name, size, sha256)].
    """

    def __init__(self, folder: Path, part_size: int, prefix: str = "part") -> None:
        super().__init__()
        if part_size < 1:
            raise BundleError(f"part size {part_size} bytes: must be >= 1")
        self.folder, self.part_size, self.prefix = folder, part_size, prefix
        self.parts: list[tuple[str, int, str]] = []
        self.whole = hashlib.sha256()
        self.size = 0
        self._f: io.BufferedWriter | None = None
        self._h = hashlib.sha256()
        self._n = 0

    def writable(self) -> bool:
        return True

    def _roll(self) -> None:
        if self._f is not None:
            self._f.close()
            self.parts.append((f"{self.prefix}-{len(self.parts):03d}", self._n, self._h.hexdigest()))
        self._f = None

    def write(self, b: bytes) -> int:  # type: ignore[override]
        view = memoryview(b).cast("B")
        done = 0
        while done < len(view):
            if self._f is None:
                self._f = open(self.folder / f"{self.prefix}-{len(self.parts):03d}", "wb")  # noqa: SIM115 (closed in _roll)
                self._h, self._n = hashlib.sha256(), 0
            take = min(self.part_size - self._n, len(view) - done)
            chunk = view[done : done + take]
            self._f.write(chunk)
            self._h.update(chunk)
            self.whole.update(chunk)
            self._n += take
            self.size += take
            done += take
            if self._n == self.part_size:
                self._roll()
        return done

    def close(self) -> None:
        if not self.closed:
            self._roll()
        super().close()


def pack(folder: Path, members: Sequence[tuple[str, Path | bytes]], part_size: int) -> PartWriter:
    """Stream an uncompressed PAX tar of ``members`` ((archive name, file or bytes), in the given order)
    into parts under ``folder``. Every header is fixed: mtime 0, uid/gid 0, no user/group names, mode 0644.
    """
    writer = PartWriter(folder, part_size)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for arcname, content in members:
            info = tarfile.TarInfo(arcname)
            info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
            if isinstance(content, bytes):
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
            else:
                info.size = content.stat().st_size
                with open(content, "rb") as f:
                    tar.addfile(info, f)
    writer.close()
    return writer


INSTALL_SH = r"""#!/usr/bin/env bash
# Installer of a certvllm offline GPU bundle. Generated by scripts/gpu_bundle.py: do not edit (it holds
# the bundle's checksums). @@SUMMARY@@
#
#   bash install.sh [KIT_DIR] [SITE_DIR]
#
# KIT_DIR: the folder holding part-000 ... (default: this script's folder). SITE_DIR: where the wheels are
# installed with pip --target (default $CERTVLLM_SITE or /tmp/site). PYTHON: the interpreter (default python3).
# Parts may arrive in several runs: each run copies its part(s) into KIT_DIR and runs this script; a run
# that finds parts missing checks those present, names the missing ones and exits 0 without installing;
# the run that completes the set reassembles bundle.tar, checks it, extracts it and installs every wheel
# (pip install --no-index --no-deps --target SITE_DIR). Messages go to stderr; when the bundle is installed
# (now or by an earlier run) the only line on stdout is the export line, so
#   eval "$(bash install.sh /tmp/kit)"
# sets PYTHONPATH (and PATH, for the console scripts) in the calling shell. Exit 1: a part or the tar is
# corrupt (copy it again), the interpreter is not the bundle's, or pip failed. KEEP=1 keeps bundle.tar and
# the extracted wheels.
set -euo pipefail
KIT=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
SITE=${2:-${CERTVLLM_SITE:-/tmp/site}}
PY=${PYTHON:-python3}
PY_TAG=@@PY_TAG@@
TAR_SHA256=@@TAR_SHA256@@
TAR_SIZE=@@TAR_SIZE@@
PARTS=(
@@PARTS@@
)
STAMP="$SITE/.certvllm-bundle-$TAR_SHA256"

say() { echo "install.sh: $*" >&2; }
die() { say "$*"; exit 1; }
export_line() { echo "export PYTHONPATH=\"$SITE\${PYTHONPATH:+:\$PYTHONPATH}\" PATH=\"$SITE/bin:\$PATH\""; }
sha256() {
    if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
    else "$PY" -c 'import hashlib,sys;h=hashlib.sha256();f=open(sys.argv[1],"rb")
for b in iter(lambda:f.read(1<<20),b""):h.update(b)
print(h.hexdigest())' "$1"; fi
}

if [ -f "$STAMP" ]; then
    say "bundle ${TAR_SHA256:0:12} already installed in $SITE"
    export_line
    exit 0
fi
[ -d "$KIT" ] || die "KIT_DIR $KIT does not exist: copy the parts there first"

missing=()
for entry in "${PARTS[@]}"; do
    name=${entry%% *}; want=${entry##* }
    if [ ! -f "$KIT/$name" ]; then missing+=("$name"); continue; fi
    got=$(sha256 "$KIT/$name")
    [ "$got" = "$want" ] ||
        die "$KIT/$name: sha256 $got, expected $want: corrupt or from another bundle; copy it again"
done
if [ ${#missing[@]} -gt 0 ]; then
    say "$(( ${#PARTS[@]} - ${#missing[@]} ))/${#PARTS[@]} parts in $KIT, all checked; missing: ${missing[*]}."
    say "Copy them into $KIT and run this again (nothing installed yet)."
    exit 0
fi

tag=$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])') || die "$PY does not run: set PYTHON="
[ "$tag" = "$PY_TAG" ] ||
    die "$PY is CPython ${tag:0:1}.${tag:1}, the bundle is for ${PY_TAG:0:1}.${PY_TAG:1}: set PYTHON=that python"
"$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip (python -m pip): the installer needs it"

tarball="$KIT/bundle.tar"
say "all ${#PARTS[@]} parts present and checked; reassembling $tarball ($TAR_SIZE bytes)"
: > "$tarball"
for entry in "${PARTS[@]}"; do cat "$KIT/${entry%% *}" >> "$tarball"; done
got=$(sha256 "$tarball")
[ "$got" = "$TAR_SHA256" ] || die "$tarball: sha256 $got, expected $TAR_SHA256 (parts concatenated in the wrong order?)"

unpacked="$KIT/unpacked"
rm -rf "$unpacked"; mkdir -p "$unpacked"
if command -v tar >/dev/null 2>&1; then tar -xf "$tarball" -C "$unpacked"
else "$PY" -c 'import sys,tarfile; t=tarfile.open(sys.argv[1])
t.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))' "$tarball" "$unpacked"
fi

mkdir -p "$SITE"
say "installing $(ls "$unpacked"/wheels/*.whl | wc -l) wheels into $SITE"
"$PY" -m pip install --no-index --no-deps --upgrade --disable-pip-version-check --no-warn-script-location \
    --quiet --target "$SITE" "$unpacked"/wheels/*.whl >&2 || die "pip install into $SITE failed (output above)"
cp "$unpacked/manifest.json" "$STAMP"
[ "${KEEP:-0}" = 1 ] || rm -rf "$tarball" "$unpacked"
say "installed; later runs: eval \"\$(bash $KIT/install.sh $KIT $SITE)\" or the export line below"
export_line
"""


def render_install_sh(
    py_tag: str, tar_sha256: str, tar_size: int, parts: Sequence[tuple[str, int, str]], summary: str
) -> str:
    """The target-side installer with this bundle's checksums filled in (see ``INSTALL_SH``)."""
    rows = "\n".join(f'    "{name} {sha}"' for name, _, sha in parts)
    return (
        INSTALL_SH.replace("@@SUMMARY@@", summary)
        .replace("@@PY_TAG@@", py_tag)
        .replace("@@TAR_SHA256@@", tar_sha256)
        .replace("@@TAR_SIZE@@", str(tar_size))
        .replace("@@PARTS@@", rows)
    )


def write_bundle(
    out: Path,
    wheels: Sequence[Path],
    manifest: dict,
    py_tag: str,
    part_size: int,
) -> dict:
    """Write ``out``: the parts of the tar (manifest + wheels), ``manifest.json``, ``install.sh``, ``SHA256SUMS``.

    ``manifest`` gets its ``wheels`` list (file, name, version, size, sha256; sorted by file) filled in or
    completed here. Files of an earlier build in ``out`` (parts, sums, script, manifest) are replaced.
    Returns a summary: parts [(name, size, sha256)], tar sha256 and size, total wheel bytes.
    """
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("part-[0-9][0-9][0-9]"), *(out / n for n in ("SHA256SUMS", "install.sh", "manifest.json"))]:
        if old.exists():
            old.unlink()
    wheels = sorted(wheels, key=lambda p: p.name)
    if len({w.name for w in wheels}) != len(wheels):
        raise BundleError(f"two wheels share a file name: {[w.name for w in wheels]}")
    extra = {w["file"]: w for w in manifest.get("wheels", [])}
    entries = []
    for w in wheels:
        name, version = wheel_name_version(w)
        entry = {"file": w.name, "name": name, "version": version, "size": w.stat().st_size, "sha256": sha256_file(w)}
        entries.append({**extra.get(w.name, {}), **entry})
    manifest = {**manifest, "wheels": entries, "total_wheel_bytes": sum(e["size"] for e in entries)}
    manifest_bytes = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    members: list[tuple[str, Path | bytes]] = [("manifest.json", manifest_bytes)]
    members += [(f"wheels/{w.name}", w) for w in wheels]
    writer = pack(out, members, part_size)
    tar_sha = writer.whole.hexdigest()
    summary = f"{len(wheels)} wheels, {manifest['total_wheel_bytes']} bytes, for CPython {py_tag[0]}.{py_tag[1:]}" + (
        f", vLLM {manifest['vllm']}" if manifest.get("vllm") else ""
    )
    script = render_install_sh(py_tag, tar_sha, writer.size, writer.parts, summary)
    (out / "install.sh").write_text(script)
    (out / "install.sh").chmod(0o755)
    (out / "manifest.json").write_bytes(manifest_bytes)
    sums = [f"{sha}  {name}" for name, _, sha in writer.parts]
    sums.append(f"{tar_sha}  {TAR_NAME}")
    sums += [f"{sha256_file(out / n)}  {n}" for n in ("install.sh", "manifest.json")]
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return {"parts": writer.parts, "tar_sha256": tar_sha, "tar_size": writer.size, "manifest": manifest}


# ---------------------------------------------------------------------------------------------------
# The command


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_bundle.py",
        description="Build the offline wheel bundle of certvllm + one vLLM release for a target without a registry.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--vllm", required=True, metavar="VERSION", help="the vLLM release, e.g. 0.26.0")
    p.add_argument("--python", required=True, metavar="X.Y[.Z]", help="the target's CPython, e.g. 3.12")
    p.add_argument(
        "--platform",
        required=True,
        metavar="TAG",
        help="the newest manylinux tag the target takes (its glibc), e.g. manylinux_2_31_x86_64; older tags follow",
    )
    p.add_argument("--target-has", required=True, type=Path, metavar="FILE", help="name==version lines (or name)")
    p.add_argument("--out", type=Path, help="output folder (default .bundle/<target-has stem>-vllm<VERSION>)")
    p.add_argument("--cache", type=Path, default=ROOT / ".bundle" / "downloads", help="downloaded wheels (reused)")
    p.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB, help="largest part, MiB")
    p.add_argument("--require", action="append", default=[], metavar="REQ", help="another root requirement")
    p.add_argument("--exclude", action="append", default=[], metavar="NAME", help="never carry NAME (adds)")
    p.add_argument("--include", action="append", default=[], metavar="NAME", help="lift a default exclusion")
    p.add_argument("--allow-carry", action="append", default=[], metavar="NAME", help="carry torch/triton anyway")
    p.add_argument("--strip", action="append", default=[], metavar="DIST:GLOB", help="another path to strip")
    p.add_argument("--lock", type=Path, help="prefer the versions of this requirements.lock (a rebuild)")
    p.add_argument("--certvllm-wheel", type=Path, help="use this certvllm wheel instead of building one")
    p.add_argument("--no-certvllm", action="store_true", help="leave certvllm out (vLLM + dependencies only)")
    p.add_argument("-v", "--verbose", action="store_true", help="show pip's output")
    return p.parse_args(argv)


def _lock_hashes(path: Path | None) -> dict[str, str]:
    """name -> sha256 hex of the ``--hash=sha256:`` entries of a lock (none for a hand-written one)."""
    out = {}
    for raw in path.read_text().splitlines() if path else []:
        m = re.match(r"^(\S+)==\S+ --hash=sha256:([0-9a-f]{64})", raw)
        if m:
            out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def prepare_wheel(src: Path, pick: Pick, rules: Sequence[StripRule], py: str, wheel_dir: Path) -> tuple[Path, dict]:
    """The file to bundle for ``pick`` (stripped into ``wheel_dir`` when a rule names it) and its manifest
    details (origin, registry url; for a stripped wheel the registry's sha256/size and what was removed).
    """
    info: dict = {"file": pick.filename, "origin": "registry", "url": pick.url}
    mine = [r for r in rules if canonicalize_name(r.dist) == pick.name]
    if not mine:
        return src, info
    log(f"stripping {src.name}")
    dst = wheel_dir / src.name
    res = rewrite_wheel(src, dst, strip_for(mine, pick.name, py))
    info.update(
        origin="stripped",
        registry_sha256=sha256_file(src),
        registry_size=src.stat().st_size,
        removed=[{"path": p, "size": n, "why": w} for p, n, w in res.removed],
    )
    unmatched = [r.pattern for r in mine if not any(r.matches(p, py) for p, _, _ in res.removed)]
    if unmatched:
        log(f"warning: strip rule(s) {unmatched} matched nothing in {src.name}: update STRIP_RULES")
        info["unmatched_strip_rules"] = unmatched
    return dst, info


def build(args: argparse.Namespace) -> tuple[Path, dict]:
    """The whole build for parsed arguments; returns the output folder and ``write_bundle``'s summary."""
    target = Target(args.python, args.platform)
    if not 0.001 <= args.part_mib <= 4096:
        raise BundleError(f"--part-mib {args.part_mib}: must be in [0.001, 4096]; the lent machine takes 52")
    try:
        Version(args.vllm)
    except InvalidVersion as exc:
        raise BundleError(f"--vllm {args.vllm!r}: not a version; e.g. 0.26.0") from exc
    target_has = read_target_has(args.target_has)
    included = {canonicalize_name(i) for i in args.include}
    excludes = {n: why for n, why in DEFAULT_EXCLUDES.items() if n not in included}
    excludes.update({canonicalize_name(n): "--exclude" for n in args.exclude})
    rules = list(STRIP_RULES)
    for s in args.strip:
        dist, sep, glob = s.partition(":")
        if not sep or not glob:
            raise BundleError(f"--strip {s!r}: expected DIST:GLOB, e.g. vllm:vllm/third_party/*.hpp")
        rules.append(StripRule(canonicalize_name(dist), glob, "--strip"))
    out = args.out or ROOT / ".bundle" / f"{args.target_has.stem}-vllm{args.vllm}"
    pip = [sys.executable, "-m", "pip"]
    proj_name, proj_version, proj_deps = read_project(ROOT)
    roots = [("vllm (root)", f"vllm=={args.vllm}")]
    if not args.no_certvllm:
        roots += [(f"{proj_name}=={proj_version}", d) for d in proj_deps]
    roots += [("--require (root)", r) for r in args.require]
    for _, r in roots:
        try:
            Requirement(r)
        except InvalidRequirement as exc:
            raise BundleError(f"requirement {r!r} is not PEP 508: {exc}") from exc
    if args.lock and not args.lock.is_file():
        raise BundleError(f"--lock {args.lock}: no such file (a requirements.lock this script wrote)")
    lock, lock_hashes = (read_lock(args.lock) if args.lock else None), _lock_hashes(args.lock)

    with tempfile.TemporaryDirectory(prefix="gpu_bundle-") as tmp_s:
        tmp = Path(tmp_s)
        t0 = time.monotonic()
        log(f"resolving vllm=={args.vllm} for CPython {target.python} on {target.platform} and older")
        allow = {canonicalize_name(n) for n in args.allow_carry}
        picker = PipPicker(target, pip, tmp, args.verbose)
        graph, picks = resolve(roots, picker, target.marker_env(), target_has, excludes, allow, lock)
        for n, p in picks.items():
            if n in lock_hashes and p.sha256 and p.sha256 != lock_hashes[n]:
                raise BundleError(f"{p.filename}: sha256 {p.sha256} differs from --lock's {lock_hashes[n]}")
        log(f"resolved {len(picks)} distributions in {time.monotonic() - t0:.1f} s")
        files = download(picks, target, pip, args.cache, args.verbose)

        wheel_dir = tmp / "wheels"
        wheel_dir.mkdir()
        details, bundle_wheels = [], []
        for name, pick in picks.items():
            path, info = prepare_wheel(files[name], pick, rules, target.py, wheel_dir)
            bundle_wheels.append(path)
            details.append({**info, "required_by": sorted(graph.nodes[name].required_by)})
        if not args.no_certvllm:
            built = args.certvllm_wheel or build_project_wheel(ROOT, tmp / "build", pip)
            if not built.is_file():
                raise BundleError(f"--certvllm-wheel {built}: no such file")
            rewrite_wheel(built, wheel_dir / built.name)
            bundle_wheels.append(wheel_dir / built.name)
            details.append({"file": built.name, "origin": "built", "required_by": ["this repository"]})

        manifest = {
            "format": FORMAT,
            "vllm": args.vllm,
            "certvllm": None if args.no_certvllm else proj_version,
            "target": {
                "python": target.python,
                "platforms": list(target.platforms),
                "abis": list(target.abis),
                "target_has": args.target_has.name,
                "target_has_sha256": sha256_file(args.target_has),
            },
            "roots": [r for _, r in roots],
            "wheels": details,
            "provided_by_target": [
                {"name": n, "target_version": str(target_has[n]) if target_has[n] else None, "required_by": sorted(w)}
                for n, w in sorted(graph.provided.items())
            ],
            "carried_over_target": [{"name": n, "why": sorted(w)} for n, w in sorted(graph.outdated.items())],
            "excluded": [
                {"name": n, "why": excludes[n], "required_by": sorted(w)} for n, w in sorted(graph.excluded.items())
            ],
            "strip_rules": [dataclasses.asdict(r) for r in rules],
        }
        result = write_bundle(out, bundle_wheels, manifest, target.py, int(args.part_mib * MIB))
    lock_lines = [f"{p.name}=={p.version} --hash=sha256:{sha256_file(files[n])}" for n, p in picks.items()]
    (out / "requirements.lock").write_text(
        f"# vllm=={args.vllm} for CPython {target.python} on {target.platform}; "
        "pip download --no-deps --require-hashes -r this file, or gpu_bundle.py --lock it\n"
        + "\n".join(lock_lines)
        + "\n"
    )
    return out, result


def main(argv: Sequence[str] | None = None) -> int:
    """Build; print a one-line summary on stdout. Exit 2 on a ``BundleError`` (message on stderr)."""
    args = parse_args(argv)
    t0 = time.monotonic()
    try:
        out, result = build(args)
    except BundleError as exc:
        print(f"gpu_bundle: error: {exc}", file=sys.stderr)
        return 2
    m = result["manifest"]
    largest = max(n for _, n, _ in result["parts"])
    print(
        f"{out}: {len(m['wheels'])} wheels, {m['total_wheel_bytes'] / MIB:.1f} MiB; "
        f"tar {result['tar_size'] / MIB:.1f} MiB in {len(result['parts'])} part(s) (largest {largest / MIB:.1f} MiB); "
        f"tar sha256 {result['tar_sha256']}; {time.monotonic() - t0:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
