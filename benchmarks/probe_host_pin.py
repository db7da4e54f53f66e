"""How long pinning the host tier takes on this machine: ``cudaHostRegister`` of a zeroed allocation of N GiB,
with and without transparent huge pages (``certvllm.kv.host.advise_huge_pages``), and what the machine reports
about its memory (MemTotal/MemAvailable, the cgroup limit, the THP mode) before and after.

Usage: python benchmarks/probe_host_pin.py [--gib 8] [--out probe.json]. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from certvllm.kv.host import advise_huge_pages


def _meminfo() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        if name in ("MemTotal", "MemAvailable", "AnonHugePages"):
            fields[name] = int(value.split()[0]) << 10
    return fields


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _pin(nbytes: int, huge: bool) -> dict[str, float | bool]:
    t0 = time.perf_counter()
    tensor = torch.zeros(nbytes, dtype=torch.uint8)
    advised = advise_huge_pages(tensor) if huge else False
    t1 = time.perf_counter()
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    t2 = time.perf_counter()
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    anon_huge = _meminfo().get("AnonHugePages", 0)
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    return {"huge_pages_advised": advised, "alloc_s": t1 - t0, "register_s": t2 - t1,
            "gib_per_s": nbytes / 2**30 / (t2 - t1), "anon_huge_pages_gib": anon_huge / 2**30}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--out", default="probe_host_pin.json")
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30)
    torch.cuda.init()
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    result = {"gib": args.gib, "meminfo_before": _meminfo(), "thp": thp,
              "cgroup_memory_max": _read("/sys/fs/cgroup/memory.max")}  # fmt: skip
    result["plain"] = _pin(nbytes, huge=False)
    result["huge"] = _pin(nbytes, huge=True)
    result["meminfo_after"] = _meminfo()
    print("| pages | register s | GiB/s | anon huge GiB |\n|---|---|---|---|")
    for name in ("plain", "huge"):
        r = result[name]
        print(f"| {name} | {r['register_s']:.2f} | {r['gib_per_s']:.1f} | {r['anon_huge_pages_gib']:.1f} |")
    print(json.dumps({k: result[k] for k in ("meminfo_before", "meminfo_after", "thp", "cgroup_memory_max")}))
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
