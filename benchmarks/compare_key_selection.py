"""Key selection rules side by side on the CPU: the paper's coverage rule (``default``) against selection by the
key-error budget (``budget``), per input family of ``certvllm.testing``, at LLaMA-3.1-8B head shapes.

For each family and preset: the share of full blocks each query head reads with unquantized keys (the
report's K*; under ``budget`` every head of a KV head reads its group's union), the share each KV head pages
in (the union over its query heads: what crosses PCIe unless resident), the median certified bound
relative to V_max, and the share of head-steps at rung 1 and at rungs 3/4 (exact recompute). Prints a table
and writes JSON.

    python benchmarks/compare_key_selection.py --contexts 2048 8192 --out benchmarks/results/key_selection_cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from certvllm.attention.op import certified_attention
from certvllm.config import load_config
from certvllm.formats.layout import BLOCK_SIZE
from certvllm.kv.pagein import PageInEngine
from certvllm.testing import FAMILIES, make_case, paged_batch

HQ, HKV, D = 32, 8, 128


def measure(family: str, preset: str, contexts: list[int], seed: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    cases = [make_case(family, t, HQ, HKV, D, torch.bfloat16, gen) for t in contexts]
    cache, tables, lens = paged_batch(cases)
    q = torch.stack([c.q for c in cases])
    pagein = PageInEngine()
    res = certified_attention(q, cache, tables, lens, load_config(preset), pagein=pagein, backend="cpu",
                              generator=torch.Generator().manual_seed(seed))  # fmt: skip
    rep = res.report
    nfull = (lens // BLOCK_SIZE).clamp(min=1).view(-1, 1).float()
    return {
        "key_share": float((rep.k_star.float() / nfull).mean()),
        "paged_key_share": pagein.take_stats().key_blocks / float(HKV * nfull.sum()),
        "bound_over_vmax_median": float((rep.bound.double() / rep.v_max.double()).median()),
        "rung1": float((rep.rung == 1).double().mean()),
        "rung3_or_4": float((rep.rung >= 3).double().mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--presets", nargs="+", default=["default", "budget"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/key_selection_cpu.json"))
    args = ap.parse_args()
    rows = [
        {"family": f, "preset": p, **measure(f, p, args.contexts, args.seed)} for f in FAMILIES for p in args.presets
    ]
    print(
        f"{'family':20} {'preset':8} {'keys/head':>9} {'paged/KV':>8} {'bound/Vmax':>10} {'rung 1':>7} {'rung 3/4':>8}"
    )
    for r in rows:
        cells = (r["key_share"], r["paged_key_share"], r["bound_over_vmax_median"], r["rung1"], r["rung3_or_4"])
        print(f"{r['family']:20} {r['preset']:8} " + "{:9.3f} {:8.3f} {:10.4f} {:7.3f} {:8.3f}".format(*cells))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
