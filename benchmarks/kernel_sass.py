"""What the compiler makes of the Gluon kernels, without a GPU: registers, stack (spilled bytes) and the
instructions of one main-loop iteration (one 16-token block per warp), per configuration.

Usage: python benchmarks/kernel_sass.py [--tuning resident_maxnreg=168 ...] [--out runs/kernel_sass.json]

Compiles the phase-1 and resident-pass Gluon kernels with the installed Triton for sm_90
(``triton_kernels/offline_compile.py``, in a child process) at LLaMA-3.1-8B shapes (G = 4, D = 128) and a
few others, with the launchers' constants for ``KernelTuning`` (the defaults, with the ``--tuning``
fields replaced), and prints one row per kernel with the loop's most frequent opcodes.
Fewer instructions per block is necessary, not sufficient: the H200 decides (``probe_resident.py``,
``profile_decode.py``). The Triton here may differ from the H200's (3.6 there), so compare variants
compiled here with each other.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parse_tuning(items: list[str]) -> dict:
    """``["resident_maxnreg=168", ...]`` → ``{"resident_maxnreg": 168, ...}``, checked by ``KernelTuning``
    (``tuning.tuning_overrides``); a bad entry exits with its message."""
    from certvllm.triton_kernels.tuning import tuning_overrides

    try:
        return tuning_overrides(items)
    except ValueError as err:
        raise SystemExit(f"--tuning: {err}") from err


def main() -> None:
    from certvllm.triton_kernels.offline_compile import run_jobs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tuning", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="KernelTuning fields to change, e.g. resident_maxnreg=168")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("runs/kernel_sass.json"))
    a = ap.parse_args()
    tuning = parse_tuning(a.tuning)
    shapes = [(32, 8, 128), (64, 8, 128), (8, 8, 64), (8, 4, 256)]
    jobs = [{"kernel": k, "hq": hq, "hkv": hkv, "d": d, "tuning": tuning}
            for hq, hkv, d in shapes for k in ("phase1", "resident")]  # fmt: skip
    rows = [dict(job, **res) for job, res in zip(jobs, run_jobs(jobs), strict=True)]
    for r in rows:
        if "missing" in r:
            raise SystemExit(r["missing"])
        print(f"{r['kernel']:8s} G={r['hq'] // r['hkv']:<2d} D={r['d']:<3d} {r['registers']:4d} registers, "
              f"{r['stack']:4d} B stack, {r['loop_instructions']:5d} instructions per iteration "
              f"({r['common_path_instructions']:5d} on the common path)  "
              + " ".join(f"{k}:{v}" for k, v in r["loop_top"].items()), flush=True)  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"arch": 90, "tuning": tuning, "rows": rows}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
