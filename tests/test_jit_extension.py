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


def test_a_lock_left_by_a_killed_build_is_cleared_and_a_live_one_kept(tmp_path):
    """torch's loader waits forever on a build folder's ``lock``; a build killed while holding it (a stopped server
    or test run) must not hang every later start, so a lock older than any build is removed, and a fresh one kept."""
    import os
    import time

    from certvllm.kernels.jit import STALE_LOCK_SECONDS, clear_stale_lock

    lock = tmp_path / "lock"
    assert not clear_stale_lock(tmp_path)
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()  # a build in progress
    old = time.time() - STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()
