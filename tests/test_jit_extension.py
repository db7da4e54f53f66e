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


def test_a_finished_build_is_imported_without_a_build_step_when_the_sources_are_copied_anew(tmp_path, monkeypatch):
    """torch's ninja build compares file times, so a tree copied anew (same bytes, new times: every run on the lent
    GPU machines) rebuilt the extension; a finished build of the same digest is imported directly instead."""
    import shutil

    import pytest
    import torch.utils.cpp_extension

    from certvllm.kernels import cpu

    try:
        built = cpu._EXT.load()
    except RuntimeError as err:
        pytest.fail(f"the CPU extension must build on the test machine: {err}")
    copies = []
    for source in cpu._EXT.sources:
        copy = tmp_path / Path(source).name
        shutil.copyfile(source, copy)  # same bytes, a new file time
        copies.append(copy)
    again = JitExtension(cpu._EXT.name, copies, "fallback", **cpu._EXT.build_args)
    assert again.build_dir == cpu._EXT.build_dir

    def no_build(*args, **kwargs):
        raise AssertionError("a finished build of this digest must not be built again")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    module = again.load()
    assert module.__file__ == built.__file__ and set(dir(built)) <= set(dir(module))
