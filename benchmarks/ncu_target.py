"""A minimal program for Nsight Compute: one certified layer call's phase-1, promotion or attend kernel at one point.

Usage (on a CUDA machine with ncu, e.g. the lent H200, where it is ``/usr/local/cuda/bin/ncu``)::

    ncu --kernel-name regex:_phase1_mma_gluon --launch-skip 1 --launch-count 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section SourceCounters --section Occupancy \\
        python benchmarks/ncu_target.py --kernel phase1 --point 8x131072

It builds the synthetic cache of ``bench_decode`` at ``batch × context`` and launches the kernel twice with
the launchers' defaults (the first launch compiles, so profile the second: ``--launch-skip 1``). For
``attend`` and ``promote`` it runs three whole certified calls instead, with one promotion pool (warm from the
second call on, as in serving); each call launches both kernels twice (the main pass, then the exact re-run, empty
when nothing escalated), so the third call's main pass is ``--launch-skip 4 --launch-count 1``
(``regex:attend_kernel``: the CUDA kernel, ``certvllm::attend_kernel<...>``; ``regex:_promote_kernel``). The
pool's counters of the last call are printed (pages looked up, hits, fills, and bypasses: pages read over PCIe
because another page held their slot). ``--dialect triton`` launches the
Triton kernels instead: phase 1's (``regex:_phase1_mma_kernel``) and the attend pass's (``_attend_kernel``, which
the same ``regex:attend_kernel`` matches).
"""

from __future__ import annotations

import argparse
import math

import torch
from bench_decode import D, build_cache, synthetic_kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=("phase1", "promote", "attend"), default="phase1")
    ap.add_argument("--point", default="8x131072", help="batch x context, e.g. 1x8192")
    ap.add_argument("--dialect", choices=("auto", "triton"), default="auto", help="KernelTuning.dialect")
    a = ap.parse_args()
    batch, ctx = (int(x) for x in a.point.lower().split("x"))
    if not torch.cuda.is_available():
        raise SystemExit("ncu_target.py needs a CUDA device (it is a launch target for Nsight Compute)")

    from certvllm.triton_kernels import phase1 as p1mod
    from certvllm.triton_kernels.common import split_plan
    from certvllm.triton_kernels.tuning import KernelTuning

    from certvllm.attention import certified_attention
    from certvllm.attention.gpu import CudaOptions, _lut
    from certvllm.bounds import delta_factor
    from certvllm.config import load_config
    from certvllm.kv.cuda_pagein import CudaPageInEngine
    from certvllm.kv.residency import Residency

    q, k, v = synthetic_kv(batch, ctx, seed=ctx + batch)
    lens = [ctx - 7] * batch
    cache, tables = build_cache(k, v, lens)
    del k, v
    dev = torch.device("cuda")
    lens_t = torch.tensor(lens, device=dev)
    kv_heads = cache.num_kv_heads
    tuning = KernelTuning(dialect=a.dialect)
    cfg = load_config("default")
    # the certified calls' pool (none for phase 1 alone)
    residency = Residency() if a.kernel == "phase1" else Residency.for_layer(cache, cfg.promotion_cache_fraction)
    for i in range(2 if a.kernel == "phase1" else 3):
        if a.kernel == "phase1":
            qs = (q.float() * (1 / math.sqrt(D))).contiguous()
            splits, bps = split_plan(tables.shape[1], batch * kv_heads, tuning=tuning)
            p1mod.phase1(qs, cache.pages, tables.long().contiguous(), lens_t // 16, _lut(dev), cache.layout,
                         kv_heads, cache.sub_blocks, delta_factor(D), splits, bps,
                         tuning=tuning)  # fmt: skip
        else:
            if i == 2 and residency.pool is not None:
                residency.pool.take_stats()  # the counters from here on are the last call's
            certified_attention(q, cache, tables, lens_t, cfg, 1 / math.sqrt(D), pagein=CudaPageInEngine(dev),
                                residency=residency, cuda_options=CudaOptions(tuning=tuning))  # fmt: skip
        torch.cuda.synchronize()
    if a.kernel != "phase1" and residency.pool is not None:
        print("promotion pool, last call:", residency.pool.take_stats())


if __name__ == "__main__":
    main()
