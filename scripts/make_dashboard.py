"""Write deploy/grafana/dashboards/certvllm.json, the Grafana dashboard of the compose stack.

    python scripts/make_dashboard.py            # rewrite the JSON
    python scripts/make_dashboard.py --check    # exit 1 when the committed JSON is out of date

The dashboard is generated so that every panel has the same shape and every query the same filter;
tests/test_deploy.py checks that the JSON is up to date and that every metric it queries is exported
by a real ``certvllm serve`` (docs/metrics.md documents them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "certvllm.json"
F = '{model_name=~"$model_name"}'
RATE = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}
CERTIFIED, RUNG3, RUNG4 = 'rung=~"0|1|2"', 'rung="3"', 'rung="4"'


def sel(extra: str = "") -> str:
    """The label filter of every query, with optional extra matchers."""
    return F if not extra else F[:-1] + "," + extra + "}"


def quantiles(metric: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{F}[{RATE}])))", f"p{round(q * 100):g}") for q in qs
    ]


class Layout:
    """Places panels left to right on a 24-column grid, rows of fixed height."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = 0
        self.y = 0
        self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "id": len(self.panels) + 1,
                "panels": [],
            }
        )
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
            self.x, self.row_h = 0, 0

    def add(self, panel: dict, w: int, h: int = 8) -> None:
        if self.x + w > 24:
            self._newline()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        panel["id"] = len(self.panels) + 1
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def targets(queries: list[tuple[str, str]], fmt: str = "time_series") -> list[dict]:
    return [
        {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i), "format": fmt}
        for i, (expr, legend) in enumerate(queries)
    ]


def timeseries(
    title: str, desc: str, queries: list[tuple[str, str]], unit: str = "short", stack: bool = False, min0: bool = True
) -> dict:
    custom = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 25 if stack else 10,
        "showPoints": "never",
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
    }
    defaults: dict = {"unit": unit, "custom": custom}
    if min0:
        defaults["min"] = 0
    return {
        "type": "timeseries",
        "title": title,
        "description": desc,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max", "lastNotNull"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets(queries),
    }


def stat(title: str, desc: str, expr: str, unit: str = "short", thresholds: tuple[float, ...] = ()) -> dict:
    steps = [{"color": "green", "value": None}]
    for value, color in zip(thresholds, ("orange", "red"), strict=False):
        steps.append({"color": color, "value": value})
    return {
        "type": "stat",
        "title": title,
        "description": desc,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}},
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        },
        "targets": targets([(expr, title)]),
    }


def heatmap(title: str, desc: str, metric: str, unit: str) -> dict:
    return {
        "type": "heatmap",
        "title": title,
        "description": desc,
        "datasource": DS,
        "fieldConfig": {"defaults": {"custom": {"scaleDistribution": {"type": "linear"}}}, "overrides": []},
        "options": {
            "calculate": False,
            "yAxis": {"unit": unit, "axisPlacement": "left"},
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "exponent": 0.5, "steps": 64},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"mode": "single", "yHistogram": False},
            "legend": {"show": True},
            "filterValues": {"le": 1e-9},
        },
        "targets": targets([(f"sum by (le) (increase({metric}_bucket{F}[{RATE}]))", "{{le}}")], fmt="heatmap"),
    }


def build() -> dict:
    lay = Layout()
    steps = f"sum(rate(vllm:cert_head_steps_total{F}[{RATE}]))"

    lay.row("Certification: fallback ladder")
    lay.add(
        stat(
            "Certified head-steps (rung ≤ 2)",
            "Share of query-head decode steps returned with a certificate (no exact recomputation).",
            f"sum(rate(vllm:cert_head_steps_total{sel(CERTIFIED)}[{RATE}])) / {steps}",
            "percentunit",
        ),
        6,
        5,
    )
    lay.add(
        stat(
            "Head fallback rate (rung 3)",
            "Share of head-steps recomputed exactly, one head at a time.",
            f"sum(rate(vllm:cert_head_steps_total{sel(RUNG3)}[{RATE}])) / {steps}",
            "percentunit",
            (0.02, 0.05),
        ),
        6,
        5,
    )
    lay.add(
        stat(
            "Layer fallback rate (rung 4)",
            "Share of head-steps inside a layer recomputed exactly.",
            f"sum(rate(vllm:cert_head_steps_total{sel(RUNG4)}[{RATE}])) / {steps}",
            "percentunit",
            (0.005, 0.01),
        ),
        6,
        5,
    )
    lay.add(
        stat(
            "Canary violations (range)",
            "Device pages that disagreed with their host shadow. Must be 0.",
            f"sum(increase(vllm:cert_canary_violations_total{F}[$__range])) or vector(0)",
            "short",
            (1,),
        ),
        6,
        5,
    )
    lay.add(
        timeseries(
            "Head-steps by rung",
            "Rate of query-head decode steps by the highest rung used: 0 certified as is, 1 coverage "
            "widened, 2 values promoted, 3 head exact, 4 layer exact.",
            [(f"sum by (rung) (rate(vllm:cert_head_steps_total{F}[{RATE}]))", "rung {{rung}}")],
            "ops",
            stack=True,
        ),
        12,
    )
    lay.add(
        timeseries(
            "Rung shares",
            "Each rung's share of all head-steps.",
            [
                (
                    f"sum by (rung) (rate(vllm:cert_head_steps_total{F}[{RATE}])) / ignoring(rung) group_left {steps}",
                    "rung {{rung}}",
                )
            ],
            "percentunit",
            stack=True,
        ),
        12,
    )
    lay.add(
        timeseries(
            "Head fallbacks by reason (rung 3)",
            "Heads recomputed exactly per second: rank (top-r order changed), boundary (a block on the "
            "selection boundary), bound_tol (certificate above bound_tol·V_max).",
            [(f"sum by (reason) (rate(vllm:cert_head_fallbacks_total{F}[{RATE}]))", "{{reason}}")],
            "ops",
        ),
        8,
    )
    lay.add(
        timeseries(
            "Head fallback rate by reason",
            "Rung-3 fallbacks as a share of all head-steps.",
            [
                (
                    f"sum by (reason) (rate(vllm:cert_head_fallbacks_total{F}[{RATE}])) / ignoring(reason) "
                    f"group_left {steps}",
                    "{{reason}}",
                )
            ],
            "percentunit",
        ),
        8,
    )
    lay.add(
        timeseries(
            "Layer fallbacks by reason (rung 4)",
            "Layers recomputed exactly per second (one sequence each): canary (page ≠ shadow), "
            "precondition (a page's precondition broke).",
            [
                (f"sum by (reason) (rate(vllm:cert_layer_fallbacks_total{F}[{RATE}]))", "{{reason}}"),
                (f"topk(5, sum by (layer) (rate(vllm:cert_layer_fallbacks_total{F}[{RATE}])))", "layer {{layer}}"),
            ],
            "ops",
        ),
        8,
    )

    lay.row("Certification: error bounds")
    lay.add(
        heatmap(
            "E_key per certified head-step", "Distribution of the returned key-error bound.", "vllm:cert_e_key", "short"
        ),
        8,
    )
    lay.add(
        heatmap(
            "E_val per certified head-step",
            "Distribution of the returned value-error bound.",
            "vllm:cert_e_val",
            "short",
        ),
        8,
    )
    lay.add(
        heatmap(
            "Certificate / V_max",
            "(E_key + E_val) / V_max per certified head-step.",
            "vllm:cert_bound_relative",
            "percentunit",
        ),
        8,
    )
    lay.add(timeseries("E_key quantiles", "Quantiles of E_key (absolute).", quantiles("vllm:cert_e_key")), 8)
    lay.add(timeseries("E_val quantiles", "Quantiles of E_val (absolute).", quantiles("vllm:cert_e_val")), 8)
    lay.add(
        timeseries(
            "Certificate / V_max quantiles",
            "Quantiles of (E_key + E_val) / V_max; compare with the preset's bound_tol.",
            quantiles("vllm:cert_bound_relative"),
            "percentunit",
        ),
        8,
    )

    lay.row("Certification: audit mode")
    lay.add(
        stat(
            "Audit violations (range)",
            "Audited head-steps farther from exact attention than their certificate allows. Must be 0.",
            f"sum(increase(vllm:cert_audit_violations_total{F}[$__range])) or vector(0)",
            "short",
            (1,),
        ),
        8,
    )
    lay.add(
        timeseries(
            "Audits by rung",
            "Head-steps re-checked against exact attention over the shadow (audit_rate of the certified ones).",
            [(f"sum by (rung) (rate(vllm:cert_audits_total{F}[{RATE}]))", "rung {{rung}}")],
            "ops",
        ),
        8,
    )
    lay.add(
        timeseries(
            "Audit error / allowed quantiles",
            "Observed error over the allowed error per audited head-step (> 1 is a violation).",
            quantiles("vllm:cert_audit_error_ratio"),
            "short",
        ),
        8,
    )

    lay.row("Certification: promotions, page-ins and host tier")
    lay.add(
        timeseries(
            "Promoted blocks per head-step",
            "Average (block, KV head) pages read with unquantized keys (K*) and values (rung 2).",
            [
                (f"sum(rate(vllm:cert_promoted_key_blocks_total{F}[{RATE}])) / {steps}", "keys"),
                (f"sum(rate(vllm:cert_promoted_value_blocks_total{F}[{RATE}])) / {steps}", "values"),
            ],
        ),
        8,
    )
    lay.add(
        timeseries(
            "Page-in bandwidth",
            "Bytes per second read from the host shadow tier, per worker rank (tensor parallelism: each rank "
            "pages in over its own link).",
            [(f"sum by (rank) (rate(vllm:cert_page_in_bytes_total{F}[{RATE}]))", "rank {{rank}}")],
            "Bps",
        ),
        8,
    )
    lay.add(
        timeseries(
            "Promoted key pages by source",
            "Where the promotion pass read unquantized keys (CUDA): the promotion cache, the step prefetch's "
            "ring, or over PCIe.",
            [(f"sum by (source) (rate(vllm:cert_key_pages_total{F}[{RATE}]))", "{{source}}")],
            "ops",
        ),
        8,
    )
    lay.add(
        timeseries(
            "Page-in time per attention call",
            "Quantiles and mean of the page-in time.",
            quantiles("vllm:cert_page_in_seconds", (0.5, 0.99))
            + [
                (
                    f"sum(rate(vllm:cert_page_in_seconds_sum{F}[{RATE}])) / "
                    f"sum(rate(vllm:cert_page_in_seconds_count{F}[{RATE}]))",
                    "mean",
                )
            ],
            "s",
        ),
        8,
    )
    lay.add(
        timeseries(
            "Host tier memory",
            "Host memory held by shadow pages (FP16 originals of every device block), per engine and worker rank "
            "(tensor parallelism: each rank shadows its own KV heads).",
            [(f"sum by (engine, rank) (vllm:cert_host_tier_bytes{F})", "engine {{engine}} rank {{rank}}")],
            "bytes",
        ),
        8,
    )
    lay.add(
        timeseries(
            "Attention layers: certified and native",
            "Attention layers holding certified pages, and those a hybrid model keeps in its own dtype (sliding-window "
            "layers, --kv-cache-dtype-skip-layers), per engine.",
            [
                (
                    f"count by (engine) (max by (engine, layer) (vllm:cert_layer_certified{F}) == 1)",
                    "engine {{engine}} certified",
                ),
                (
                    f"count by (engine) (max by (engine, layer) (vllm:cert_layer_certified{F}) == 0)",
                    "engine {{engine}} native",
                ),
            ],
        ),
        8,
    )
    lay.add(
        timeseries(
            "Exact tokens by policy",
            "Query tokens served by exact attention by policy (not a fallback): prefill, prefill_cached, dense_mode.",
            [(f"sum by (reason) (rate(vllm:cert_exact_tokens_total{F}[{RATE}]))", "{{reason}}")],
            "ops",
        ),
        8,
    )
    lay.add(
        timeseries(
            "KV cache usage",
            "Share of KV blocks in use (capped by the host tier budget).",
            [(f"max(vllm:kv_cache_usage_perc{F})", "KV usage")],
            "percentunit",
        ),
        8,
    )

    lay.row("vLLM: throughput and latency")
    lay.add(
        timeseries(
            "Token throughput",
            "Prompt and generated tokens per second.",
            [
                (f"sum(rate(vllm:prompt_tokens_total{F}[{RATE}]))", "prompt"),
                (f"sum(rate(vllm:generation_tokens_total{F}[{RATE}]))", "generation"),
            ],
            "ops",
        ),
        8,
    )
    lay.add(
        timeseries(
            "Requests",
            "Running and waiting requests; finished requests per second by reason.",
            [
                (f"sum(vllm:num_requests_running{F})", "running"),
                (f"sum(vllm:num_requests_waiting{F})", "waiting"),
                (
                    f"sum by (finished_reason) (rate(vllm:request_success_total{F}[{RATE}]))",
                    "finished: {{finished_reason}}",
                ),
            ],
        ),
        8,
    )
    lay.add(
        timeseries(
            "Preemptions",
            "Requests preempted per second (KV cache too small).",
            [(f"sum(rate(vllm:num_preemptions_total{F}[{RATE}]))", "preemptions")],
            "ops",
        ),
        8,
    )
    lay.add(timeseries("Time to first token", "", quantiles("vllm:time_to_first_token_seconds"), "s"), 8)
    lay.add(timeseries("Inter-token latency", "", quantiles("vllm:inter_token_latency_seconds"), "s"), 8)
    lay.add(timeseries("End-to-end request latency", "", quantiles("vllm:e2e_request_latency_seconds"), "s"), 8)
    lay.add(
        timeseries(
            "Prefix cache hit rate",
            "Share of prompt tokens found in the prefix cache.",
            [
                (
                    f"sum(rate(vllm:prefix_cache_hits_total{F}[{RATE}])) / "
                    f"sum(rate(vllm:prefix_cache_queries_total{F}[{RATE}]))",
                    "hit rate",
                )
            ],
            "percentunit",
        ),
        8,
    )
    lay.add(timeseries("Queue time", "", quantiles("vllm:request_queue_time_seconds"), "s"), 8)
    lay.add(
        timeseries(
            "Scrape health", "1 while Prometheus reaches certvllm's /metrics.", [('up{job="certvllm"}', "{{instance}}")]
        ),
        8,
    )

    return {
        "uid": "certvllm",
        "title": "certvllm",
        "description": "Certified KV cache (vllm:cert_*) next to vLLM's own serving metrics (vllm:*).",
        "tags": ["certvllm", "vllm"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {"text": "Prometheus", "value": "prometheus"},
                    "hide": 0,
                    "refresh": 1,
                },
                {
                    "name": "model_name",
                    "label": "Model",
                    "type": "query",
                    "datasource": DS,
                    "query": {"query": "label_values(vllm:num_requests_running, model_name)", "refId": "models"},
                    "definition": "label_values(vllm:num_requests_running, model_name)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "refresh": 2,
                    "sort": 1,
                    "current": {"text": "All", "value": "$__all"},
                    "hide": 0,
                },
            ]
        },
        "annotations": {"list": []},
        "links": [],
        "panels": lay.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the committed JSON differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python scripts/make_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
