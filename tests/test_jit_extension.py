"""The C++ extension build folders: one per source content and build arguments, so two checkouts (or a test
run next to a server of another version) never rebuild one folder under each other."""

from __future__ import annotations

from pathlib import Path

from certvllm.kernels.jit import JitExtension


def test_the_build_folder_follows_the_sources_and_the_arguments(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("certvllm.kernels.jit.extensions_root", lambda: tmp_path / "ext")
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int f() { return 1; }\n")
    b.write_text("int f() { return 1; }\n")  # same bytes elsewhere (another checkout): the same folder
    one = JitExtension("demo-avx2fma", [a], "fallback", extra_cflags=["-O3"])
    assert one.build_dir == JitExtension("demo-avx2fma", [b], "fallback", extra_cflags=["-O3"]).build_dir
    assert one.build_dir.parent == tmp_path / "ext" and one.build_dir.name.startswith("demo-avx2fma-")
    assert one.build_dir != JitExtension("demo-avx2fma", [a], "fallback", extra_cflags=["-O2"]).build_dir
    before = one.build_dir
    a.write_text("int f() { return 2; }\n")  # a new version of the source: a new folder
    assert one.build_dir != before and before.is_dir()
