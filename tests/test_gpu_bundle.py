"""scripts/gpu_bundle.py, offline: wheel rewriting, packing, the installer, and the requirement walk.

Nothing here reaches a registry: the wheels are synthetic (built with zipfile in tmp_path), the package
index of the resolver tests is a dict, and pip only installs local files (``--no-index``). The real
build (``python scripts/gpu_bundle.py ...``, ~300 MB from the registry) is described in
docs/deployment.md, "Offline GPU bundle".
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PY_TAG = f"{sys.version_info[0]}{sys.version_info[1]}"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_bundle", ROOT / "scripts" / "gpu_bundle.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bundle"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


gb = _load()


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(
    folder: Path,
    files: dict[str, bytes],
    name: str = "demo",
    version: str = "1.0",
    executable: frozenset[str] = frozenset(),
    reverse: bool = False,
    date: tuple[int, int, int, int, int, int] = (2024, 5, 6, 7, 8, 10),
) -> Path:
    """A valid py3-none-any wheel holding ``files`` plus METADATA/WHEEL/RECORD, written in any order."""
    di = f"{name}-{version}.dist-info"
    meta = {
        f"{di}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{di}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    everything = {**files, **meta}
    record = "".join(f"{p},{_digest(d)},{len(d)}\n" for p, d in everything.items()) + f"{di}/RECORD,,\n"
    everything[f"{di}/RECORD"] = record.encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    items = sorted(everything.items(), reverse=reverse)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(zipfile.ZipInfo(f"{name}/", date_time=date), b"")  # a directory entry: dropped by rewrite
        for p, d in items:
            info = zipfile.ZipInfo(p, date_time=date)
            info.external_attr = (0o100755 if p in executable else 0o100600) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, d)
    return path


DEMO = {
    "demo/__init__.py": b"VALUE = 42\n",
    "demo/big.bin": os.urandom(5000),
    "demo/_C.cpython-311-x86_64-linux-gnu.so": b"\x7fELF311",
    "demo/_C.cpython-312-x86_64-linux-gnu.so": b"\x7fELF312",
    "demo/tool": b"#!/bin/sh\necho hi\n",
    "demo/data, with comma.txt": b"csv quoting\n",
}
RULES = (
    gb.StripRule("demo", "demo/big.bin", "too big"),
    gb.StripRule("demo", "demo/_C.cpython-*.so", "other pythons", keep="demo/_C.cpython-{py}-*.so"),
)


def _pip_install(wheels: list[Path], site: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", "--target", str(site)]
    subprocess.run([*cmd, *map(str, wheels)], check=True, capture_output=True, timeout=120)


def test_rewrite_wheel_strips_rewrites_record_and_pip_installs(tmp_path: Path) -> None:
    src = make_wheel(tmp_path, DEMO, executable=frozenset({"demo/tool"}))
    (tmp_path / "out").mkdir()
    dst = tmp_path / "out" / src.name
    res = gb.rewrite_wheel(src, dst, gb.strip_for(RULES, "demo", "312"))
    assert [p for p, _, _ in res.removed] == ["demo/_C.cpython-311-x86_64-linux-gnu.so", "demo/big.bin"]
    assert dict((p, w) for p, _, w in res.removed)["demo/big.bin"] == "too big"

    with zipfile.ZipFile(dst) as zf:
        assert zf.testzip() is None
        names = zf.namelist()
        assert names[-1] == "demo-1.0.dist-info/RECORD"  # dist-info last, RECORD last of all
        assert names[:-1] == sorted(names[:-1], key=lambda n: (n.startswith("demo-1.0.dist-info/"), n))
        assert not any(n.endswith("/") for n in names)
        assert all(i.date_time == (1980, 1, 1, 0, 0, 0) and not i.extra for i in zf.infolist())
        modes = {i.filename: i.external_attr >> 16 for i in zf.infolist()}
        assert modes["demo/tool"] == 0o100755 and modes["demo/__init__.py"] == 0o100644
        rows = list(csv.reader(io.StringIO(zf.read("demo-1.0.dist-info/RECORD").decode())))
        assert rows[-1] == ["demo-1.0.dist-info/RECORD", "", ""]
        assert [r[0] for r in rows] == names
        for path, digest, size in rows[:-1]:
            data = zf.read(path)
            assert digest == _digest(data) and "=" not in digest[len("sha256=") :] and int(size) == len(data)

    site = tmp_path / "site"
    _pip_install([dst], site)
    assert (site / "demo" / "__init__.py").read_bytes() == DEMO["demo/__init__.py"]
    assert (site / "demo" / "_C.cpython-312-x86_64-linux-gnu.so").exists()
    assert not (site / "demo" / "big.bin").exists()
    assert not (site / "demo" / "_C.cpython-311-x86_64-linux-gnu.so").exists()
    assert (site / "demo" / "data, with comma.txt").exists()


def test_rewrite_wheel_is_deterministic_and_refuses_a_corrupt_record(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    wa = make_wheel(a, DEMO)
    wb = make_wheel(b, DEMO, reverse=True, date=(2031, 12, 31, 23, 59, 58), executable=frozenset())
    outs = []
    for i, w in enumerate((wa, wb, wa)):
        out = tmp_path / f"out{i}"
        out.mkdir()
        gb.rewrite_wheel(w, out / w.name, gb.strip_for(RULES, "demo", "312"))
        outs.append((out / w.name).read_bytes())
    assert outs[0] == outs[1] == outs[2]

    bad = tmp_path / "bad"
    bad.mkdir()
    with zipfile.ZipFile(wa) as zin, zipfile.ZipFile(bad / wa.name, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            zout.writestr(info, b"VALUE = 43\n" if info.filename == "demo/__init__.py" else data)
    with pytest.raises(gb.BundleError, match="demo/__init__.py hashes to .* but RECORD says"):
        gb.rewrite_wheel(bad / wa.name, tmp_path / "x.whl")


def test_parts_split_and_reassemble_with_checksums(tmp_path: Path) -> None:
    blob = os.urandom(23_456)
    members = [("manifest.json", b'{"a": 1}\n'), ("wheels/x.whl", blob)]
    (tmp_path / "p").mkdir()
    w = gb.pack(tmp_path / "p", members, part_size=4096)
    sizes = [n for _, n, _ in w.parts]
    assert all(n == 4096 for n in sizes[:-1]) and 0 < sizes[-1] <= 4096 and sum(sizes) == w.size
    assert [p for p, _, _ in w.parts] == [f"part-{i:03d}" for i in range(len(sizes))]
    whole = b"".join((tmp_path / "p" / name).read_bytes() for name, _, _ in w.parts)
    assert hashlib.sha256(whole).hexdigest() == w.whole.hexdigest()
    for name, _, sha in w.parts:
        assert hashlib.sha256((tmp_path / "p" / name).read_bytes()).hexdigest() == sha
    with tarfile.open(fileobj=io.BytesIO(whole)) as tar:
        infos = tar.getmembers()
        assert [i.name for i in infos] == ["manifest.json", "wheels/x.whl"]
        assert all((i.mtime, i.uid, i.gid, i.uname, i.gname, i.mode) == (0, 0, 0, "", "", 0o644) for i in infos)
        assert tar.extractfile("wheels/x.whl").read() == blob


def _bundle(tmp_path: Path, out: Path, py_tag: str = PY_TAG, part_size: int = 3000) -> dict:
    src = tmp_path / "src"
    if not src.exists():
        src.mkdir()
        make_wheel(src, {"demo/__init__.py": b"VALUE = 42\n", "demo/noise.bin": os.urandom(9000)})
        make_wheel(src, {"helper/__init__.py": b"X = 1\n"}, name="helper", version="2.0")
    manifest = {"format": gb.FORMAT, "vllm": "0.0.0", "wheels": [{"file": "demo-1.0-py3-none-any.whl", "origin": "t"}]}
    return gb.write_bundle(out, sorted(src.glob("*.whl")), manifest, py_tag, part_size)


def test_bundle_is_byte_identical_across_builds(tmp_path: Path) -> None:
    r1 = _bundle(tmp_path, tmp_path / "one")
    r2 = _bundle(tmp_path, tmp_path / "two")
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "two").iterdir())
    assert {"SHA256SUMS", "install.sh", "manifest.json", "part-000", "part-003"} <= set(files)
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert r1["tar_sha256"] == r2["tar_sha256"]
    sums = dict(reversed(line.split("  ")) for line in (tmp_path / "one" / "SHA256SUMS").read_text().splitlines())
    assert sums["bundle.tar"] == r1["tar_sha256"]
    for name in files:
        if name in sums:
            assert hashlib.sha256((tmp_path / "one" / name).read_bytes()).hexdigest() == sums[name]
    wheels = r1["manifest"]["wheels"]
    assert [w["name"] for w in wheels] == ["demo", "helper"] and wheels[0]["origin"] == "t"
    assert all(len(w["sha256"]) == 64 and w["size"] > 0 for w in wheels)
    text = (tmp_path / "one" / "manifest.json").read_text() + (tmp_path / "one" / "install.sh").read_text()
    assert str(tmp_path) not in text  # no path of the building machine in what travels


def _run_install(kit: Path, site: Path, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": python}
    return subprocess.run(
        ["bash", str(kit / "install.sh"), str(kit), str(site)], capture_output=True, text=True, env=env, timeout=120
    )


def test_install_sh_collects_parts_over_several_runs_then_installs(tmp_path: Path) -> None:
    out, kit, site = tmp_path / "out", tmp_path / "kit", tmp_path / "site"
    result = _bundle(tmp_path, out)
    parts = [name for name, _, _ in result["parts"]]
    assert len(parts) >= 3
    kit.mkdir()
    shutil.copy(out / "install.sh", kit)
    for i, name in enumerate(parts):  # one part per "run"
        shutil.copy(out / name, kit)
        proc = _run_install(kit, site)
        assert proc.returncode == 0, proc.stderr
        if i < len(parts) - 1:
            assert proc.stdout == "" and f"{i + 1}/{len(parts)} parts" in proc.stderr and not site.exists()
    line = proc.stdout.strip()
    assert line.startswith(f'export PYTHONPATH="{site}') and "\n" not in line
    check = subprocess.run(
        [sys.executable, "-c", "import demo, helper; print(demo.VALUE + helper.X)"],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert check.stdout.strip() == "43", check.stderr
    assert not (kit / "bundle.tar").exists() and not (kit / "unpacked").exists()
    again = _run_install(kit, site)  # a later run: no work, same export line
    assert again.returncode == 0 and again.stdout.strip() == line and "already installed" in again.stderr


def test_install_sh_refuses_a_corrupt_part_and_the_wrong_python(tmp_path: Path) -> None:
    out, kit = tmp_path / "out", tmp_path / "kit"
    _bundle(tmp_path, out)
    shutil.copytree(out, kit)
    data = bytearray((kit / "part-001").read_bytes())
    data[100] ^= 0xFF
    (kit / "part-001").write_bytes(data)
    proc = _run_install(kit, tmp_path / "site")
    assert proc.returncode == 1 and "part-001: sha256" in proc.stderr and "copy it again" in proc.stderr

    other = tmp_path / "other"
    _bundle(tmp_path, other, py_tag="39")
    proc = _run_install(other, tmp_path / "site")
    assert proc.returncode == 1 and "the bundle is for 3.9" in proc.stderr


ENV = gb.Target("3.12", "manylinux_2_31_x86_64").marker_env()


def _pick(name: str, version: str, *deps: str) -> gb.Pick:
    return gb.Pick(name, version, f"{name}-{version}-py3-none-any.whl", f"https://x/{name}", "", tuple(deps))


def test_walk_evaluates_markers_for_the_target_and_skips_what_it_has() -> None:
    picks = {
        "app": _pick(
            "app",
            "1.0",
            "torch==2.11.0",
            "numpy>=1.26",
            "typing-extensions>=4.16",
            'newpy>=1; python_version >= "3.12"',
            'oldpy; python_version < "3.12"',
            'arm; platform_machine == "aarch64"',
            'win; sys_platform == "win32"',
            "plug[fast]>=2",
            "heavy",
            'bench; extra == "bench"',
            "apache-tvm-ffi",
        ),
        "plug": _pick("plug", "2.1", 'speedup; extra == "fast"', 'slow; extra == "other"', "heavy>=3"),
        "apache-tvm-ffi": _pick("apache-tvm-ffi", "0.1.10"),
    }
    has = {"torch": Version("2.11.0+cu130"), "numpy": None, "typing-extensions": Version("4.12.2")}
    g = gb.walk([("root", "app")], picks, ENV, has, {"heavy": "too big"})
    assert sorted(g.nodes) == [
        "apache-tvm-ffi",
        "app",
        "newpy",
        "plug",
        "speedup",
        "torch-c-dlpack-ext",
        "typing-extensions",
    ]
    assert sorted(g.provided) == ["numpy", "torch"]  # +cu130 meets ==2.11.0; a bare name meets anything
    assert g.excluded == {"heavy": {"app==1.0", "plug==2.1"}}
    assert "target has 4.12.2" in next(iter(g.outdated["typing-extensions"]))  # too old there: carried
    assert g.nodes["plug"].extras == {"fast"} and g.nodes["plug"].specifier == SpecifierSet(">=2")
    assert g.nodes["torch-c-dlpack-ext"].required_by == {"apache-tvm-ffi==0.1.10 (undeclared)"}
    assert not g.conflicts

    g39 = gb.walk([("root", "app")], picks, gb.Target("3.11", "manylinux_2_17_aarch64").marker_env(), has, {})
    assert {"oldpy", "arm", "heavy"} <= set(g39.nodes) and "newpy" not in g39.nodes

    pinned = {"app": _pick("app", "1.0", "torch==2.14.0")}
    assert "pass --allow-carry torch" in gb.walk([("root", "app")], pinned, ENV, has, {}).conflicts[0]
    assert "torch" in gb.walk([("root", "app")], pinned, ENV, has, {}, allow_carry={"torch"}).nodes


def _fake_index(index: dict[str, dict[str, tuple[str, ...]]], calls: list[list[str]]):
    """A pick function over {name: {version: requires_dist}}: the newest version meeting the requirement."""
    from packaging.requirements import Requirement

    def pick(reqs: list[str]) -> dict[str, gb.Pick]:
        calls.append(list(reqs))
        out = {}
        for r in reqs:
            req = Requirement(r)
            versions = sorted(index[req.name], key=Version)
            ok = [v for v in versions if req.specifier.contains(Version(v), prereleases=True)]
            if not ok:
                raise gb.NoMatch(r, versions, f"no wheel of {r}")
            out[req.name] = _pick(req.name, ok[-1], *index[req.name][ok[-1]])
        return out

    return pick


def test_resolve_reaches_a_fixed_point_and_backtracks_one_step() -> None:
    index = {
        "vllm": {"1.0": ("tvm==0.10", "xg<1", "frontend", "lib")},
        "tvm": {"0.9": (), "0.10": (), "0.11": ()},
        "xg": {"0.7": ("tvm>=0.10",), "0.8": ("tvm>=0.11",), "0.9": ("tvm>=0.11",), "1.0": ()},
        "frontend": {"1.28": ("tvm",), "1.32": ("tvm>=0.11",)},
        "lib": {"1.0": ("base<2",)},
        "base": {"1.5": (), "2.0": ()},
        "app": {"1.0": ("base",)},  # asks first, gets base 2.0, which lib's base<2 then sends back
    }
    calls: list[list[str]] = []
    g, picks = gb.resolve([("root", "app"), ("vllm (root)", "vllm==1.0")], _fake_index(index, calls), ENV, {}, {})
    assert {n: p.version for n, p in picks.items()} == {
        "app": "1.0", "base": "1.5", "frontend": "1.28", "lib": "1.0", "tvm": "0.10", "vllm": "1.0", "xg": "0.7",
    }  # fmt: skip
    assert set(g.nodes) == set(picks)
    assert any("xg<1,!=0.8,!=0.9" in r or "xg!=0.8,!=0.9,<1" in r for c in calls for r in c)

    lock_calls: list[list[str]] = []
    _, again = gb.resolve(
        [("root", "app"), ("vllm (root)", "vllm==1.0")],
        _fake_index(index, lock_calls),
        ENV,
        {},
        {},
        lock={"xg": "0.7", "frontend": "1.28", "base": "1.5"},
    )
    assert {n: p.version for n, p in again.items()} == {n: p.version for n, p in picks.items()}
    assert len(lock_calls) < len(calls)  # the lock skips the backtracking

    # the target's typing-extensions meets x (met first) but not app: carried, and x's <4.20 still counts
    index2 = {"x": {"1": ("typing-extensions<4.20",)}, "app": {"1": ("typing-extensions>=4.16",)}}
    index2["typing-extensions"] = {"4.16.0": (), "4.21.0": ()}
    has = {"typing-extensions": Version("4.12.2")}
    g, picks = gb.resolve([("r", "x"), ("r", "app")], _fake_index(index2, []), ENV, has, {})
    assert picks["typing-extensions"].version == "4.16.0" and "typing-extensions" not in g.provided
    assert g.nodes["typing-extensions"].required_by == {"x==1", "app==1"}

    with pytest.raises(gb.BundleError, match="who asks for tvm: vllm==1.0: ==0.10"):
        gb.resolve([("root", "vllm==1.0")], _fake_index({**index, "tvm": {"0.9": ()}}, []), ENV, {}, {})


def test_target_files_and_platform_tags(tmp_path: Path) -> None:
    f = tmp_path / "has.txt"
    f.write_text("# comment\nTorch==2.11.0+cu130\nnumpy  # any version\nmy_pkg @ file:///x/y.whl\n\nPyYAML==6.0.2\n")
    assert gb.read_target_has(f) == {
        "torch": Version("2.11.0+cu130"),
        "numpy": None,
        "my-pkg": None,
        "pyyaml": Version("6.0.2"),
    }
    f.write_text("torch==2.11\n-e git+https://x#egg=y\n")
    with pytest.raises(gb.BundleError, match=r"has.txt:2: '-e git"):
        gb.read_target_has(f)
    h200 = gb.read_target_has(ROOT / "deploy" / "targets" / "h200.txt")
    assert h200["torch"] == Version("2.11.0+cu130") and h200["triton"] == Version("3.6.0")
    assert "typing-extensions" not in h200 and "anyio" not in h200  # the image's are too old: carried

    tags = gb.expand_platform("manylinux_2_31_x86_64")
    assert tags[0] == "manylinux_2_31_x86_64" and tags[-1] == "manylinux1_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64"} <= set(tags)
    assert gb.expand_platform("manylinux2014_aarch64")[0] == "manylinux_2_17_aarch64"
    with pytest.raises(gb.BundleError, match="expected manylinux_2_N_ARCH"):
        gb.expand_platform("macosx_14_0_arm64")
    assert gb.Target("3.12.3", "manylinux_2_31_x86_64").marker_env()["python_full_version"] == "3.12.3"
    assert gb.main(["--vllm", "0.26.0", "--python", "3.12", "--platform", "win_amd64", "--target-has", str(f)]) == 2
