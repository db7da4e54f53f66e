"""Plot a ``benchmarks/bench_serving.py`` results file: output tokens/s against context length.

Usage: python benchmarks/plot_serving.py RESULTS.json OUT.png

One panel per concurrency, one line per KV cache dtype through its measured cells (skipped, failed or
unfinished cells have no point), log-2 context axis. Works on partial results (a run cut short).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on the machines this runs on
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"certified": ("tab:red", "o"), "auto": ("tab:blue", "s"), "fp8": ("tab:green", "^")}


def series(doc: dict[str, Any]) -> dict[int, dict[str, list[tuple[int, float]]]]:
    """``{concurrency: {dtype: [(context, output tok/s), ...]}}`` over the results' measured cells."""
    out: dict[int, dict[str, list[tuple[int, float]]]] = {}
    for cell in doc["cells"]:
        if cell.get("status") == "ok" and cell.get("output_tok_s"):
            out.setdefault(cell["concurrency"], {}).setdefault(cell["dtype"], []).append(
                (cell["context"], cell["output_tok_s"])
            )
    for per_dtype in out.values():
        for points in per_dtype.values():
            points.sort()
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    """Write the figure of ``doc`` to ``path``."""
    data = series(doc)
    concurrencies = sorted(data) or [0]
    dtypes = doc.get("args", {}).get("dtypes") or sorted({d for per in data.values() for d in per})
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(4.2 * len(concurrencies), 3.6), squeeze=False)
    for ax, concurrency in zip(axes[0], concurrencies, strict=True):
        for dtype in dtypes:
            points = data.get(concurrency, {}).get(dtype)
            if not points:
                continue
            color, marker = STYLE.get(dtype, (None, "x"))
            ax.plot([c for c, _ in points], [t for _, t in points], marker=marker, color=color, label=dtype)
        ax.set_xscale("log", base=2)
        contexts = sorted({c for points in data.get(concurrency, {}).values() for c, _ in points})
        if contexts:  # ticks at the measured contexts, labelled 8K, 32K, ...
            ax.set_xticks(contexts, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts])
            ax.minorticks_off()
        ax.set_title(f"concurrency {concurrency}")
        ax.set_xlabel("context (tokens)")
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend()
    axes[0][0].set_ylabel("output tokens/s")
    env = doc.get("environment", {}).get("engine", {})
    fig.suptitle(f"vLLM {env.get('vllm', '?')} serving, {env.get('device', '?')}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    plot(json.loads(args.results.read_text()), args.out)
    print(f"→ {args.out}")


if __name__ == "__main__":
    main()
