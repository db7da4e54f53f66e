"""Soak test of ``certvllm serve``: many concurrent streaming clients for minutes, then a leak check.

Starts ``certvllm serve`` of the bundled model with ``--kv-cache-dtype certified`` (the command line and
environment of the test-suite's shared server, ``tests/servers.py``: ``certified_serve_command``,
``serve_env``), or attaches to a running server with ``--url``. Then ``--clients`` concurrent clients each
send streamed requests one after the other for ``--minutes``, against ``/v1/completions`` (token-id prompts,
``ignore_eos``) and ``/v1/chat/completions`` (pseudo-word text), with prompt lengths drawn log-uniformly from
``--min-prompt`` to near ``max_model_len − max_tokens`` (a share of them starting with one of a few shared
prefixes, so that prefix-cached blocks are shared between live requests) and ``max_tokens`` uniform in
``--max-tokens LO HI``. A fraction ``--abort-fraction`` of the requests is closed by the client mid-stream
after a random number of tokens (vLLM then aborts them). At the end, requests still running get ``--drain-s``
seconds to finish; the rest are closed and counted as ``cut`` (also deliberate).

It reports requests completed / aborted / cut / errored (an error is anything not deliberate: an HTTP error,
a connection failure, a read timeout of ``--request-timeout-s``, a stream without ``[DONE]``, a finish reason
other than ``stop``/``length``, a token count that disagrees with the usage or with ``max_tokens``), tokens
served, p50/p99 TTFT and inter-token latency (from per-chunk usage, ``continuous_usage_stats``: a chunk of k
tokens gives k gaps), the server process group's RSS sampled every ``--rss-interval-s`` (the first sample
after the warm-up, the first ``--warmup-fraction`` of the run; the last; the growth between them), the
server's counters over the run (tokens, finished requests by reason, preemptions, certvllm head-steps,
audits and violations), and — after the clients stop and the metrics settle — the KV blocks still in use
(``vllm:kv_cache_usage_perc`` × the block count of ``vllm:cache_config_info``) and the host tier
(``vllm:cert_host_tier_bytes``, which must not change: shadow pages are indexed by block id, so no block in
use means no shadow page in use). It prints a table and writes JSON (``--out``, default
``runs/soak_<time>.json``).

    .venv/bin/python benchmarks/soak.py --minutes 10 --clients 64 --out benchmarks/results/soak_cpu_64.json
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8000 --minutes 1 --clients 8

Exit status 0 when every target holds (no error, no leaked block, host tier unchanged, RSS growth below
``--rss-growth-limit``), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import re
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _folder in (ROOT / "tests", ROOT / "benchmarks"):  # servers.py (the shared server start), bench_serving.py
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from bench_serving import percentile, request_figures  # noqa: E402
from servers import (  # noqa: E402
    SERVED_NAME,
    SERVER_MODEL,
    certified_serve_command,
    free_port,
    http_get,
    http_post,
    scrape,
    serve_env,
    serving,
)

SCHEMA = "certvllm.soak/1"
OUTCOMES = ("completed", "aborted", "cut", "error")
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pha", "dra", "gon", "ber", "lin", "qua", "ost")


@dataclass
class SoakConfig:
    """What the clients do; the defaults are the CPU soak of issue 19 (64 clients, 10 minutes)."""

    clients: int = 64
    duration_s: float = 600.0
    abort_fraction: float = 0.1
    chat_fraction: float = 0.5
    min_prompt: int = 8
    max_prompt: int | None = None  # default: max_model_len − max_tokens_hi − margin_tokens
    margin_tokens: int = 32
    max_tokens_lo: int = 16
    max_tokens_hi: int = 128
    shared_prefix_fraction: float = 0.25
    shared_prefix_tokens: int = 128
    shared_prefixes: int = 4
    warmup_fraction: float = 0.2
    rss_interval_s: float = 5.0
    request_timeout_s: float = 300.0
    drain_s: float = 120.0
    settle_timeout_s: float = 120.0
    ramp_s: float = 10.0
    seed: int = 0
    rss_growth_limit: float = 0.05


@dataclass
class Request:
    """One request's plan and what came back."""

    client: int
    endpoint: str  # "completions" or "chat"
    target_prompt: int
    max_tokens: int
    abort_at: int | None  # close the stream once this many tokens have arrived
    start: float = 0.0  # seconds since the run's start
    outcome: str = "error"
    error: str | None = None
    tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------
# prompts


class Prompts:
    """Token-id prompts for ``/v1/completions`` and pseudo-word messages for chat, sized in the server's tokens.

    Token ids come from tokenizing pseudo-word text on the server (``/tokenize``), so they are ordinary text
    tokens of whatever model it serves; the chat text's tokens per word and the chat template's overhead are
    measured the same way, and chat prompts aim 10 % below their target so that none exceeds it."""

    def __init__(self, base: str, model: str, cfg: SoakConfig, rng: random.Random) -> None:
        self.rng = rng
        text = self.words(2000)
        ids = http_post(base + "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})["tokens"]
        self.pool = sorted(set(ids))
        self.tokens_per_word = len(ids) / 2000
        sample = self.words(200)
        plain = http_post(base + "/tokenize", {"model": model, "prompt": sample, "add_special_tokens": False})
        chat = http_post(base + "/tokenize", {"model": model, "messages": [{"role": "user", "content": sample}]})
        self.chat_overhead = max(0, chat["count"] - plain["count"])
        self.prefixes = [[rng.choice(self.pool) for _ in range(cfg.shared_prefix_tokens)]
                         for _ in range(cfg.shared_prefixes)]  # fmt: skip
        self.cfg = cfg

    def words(self, n: int) -> str:
        """``n`` pseudo-words of two or three syllables."""
        return " ".join("".join(self.rng.choice(SYLLABLES) for _ in range(self.rng.randint(2, 3))) for _ in range(n))

    def token_prompt(self, length: int) -> list[int]:
        """``length`` token ids; a share starts with one of the shared prefixes."""
        head: list[int] = []
        if length > self.cfg.shared_prefix_tokens and self.rng.random() < self.cfg.shared_prefix_fraction:
            head = list(self.rng.choice(self.prefixes))
        return head + [self.rng.choice(self.pool) for _ in range(length - len(head))]

    def chat_messages(self, length: int) -> list[dict[str, str]]:
        """One user message whose templated prompt is at most about ``length`` tokens."""
        words = max(1, int((length - self.chat_overhead) * 0.9 / self.tokens_per_word))
        return [{"role": "user", "content": self.words(words)}]


# ----------------------------------------------------------------------------------------------------------
# server process memory


def listener_pid(url: str) -> int | None:
    """The process listening on ``url``'s port on this machine, if it can be seen."""
    import psutil

    port = urllib.parse.urlsplit(url).port or 80
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    return None


def group_rss(pgid: int) -> tuple[int, int]:
    """(summed RSS in bytes, process count) of the live processes of process group ``pgid``: the server, its
    API server and engine processes (``certvllm serve`` starts them in one group)."""
    import psutil

    total, count = 0, 0
    for p in psutil.process_iter(["pid", "status", "memory_info"]):
        with contextlib.suppress(psutil.Error, OSError):
            if p.info["status"] == psutil.STATUS_ZOMBIE or os.getpgid(p.pid) != pgid:
                continue
            total += p.info["memory_info"].rss
            count += 1
    return total, count


def rss_summary(samples: list[dict[str, float]], warm_t: float, end_t: float) -> dict[str, Any]:
    """The RSS figures of the run: the first sample at or after ``warm_t`` (end of warm-up), the last one at or
    before ``end_t`` (the clients stopped), the growth between them and the largest sample in between."""
    window = [s for s in samples if warm_t <= s["t"] <= end_t]
    if not window:
        return {"samples": len(samples), "first_after_warmup": None, "last": None, "growth": None}
    first, last = window[0], window[-1]
    peak = max(s["rss"] for s in window)
    return {"samples": len(samples), "window_samples": len(window), "first_after_warmup_t": first["t"],
            "first_after_warmup": first["rss"], "last_t": last["t"], "last": last["rss"], "max": peak,
            "growth": (last["rss"] - first["rss"]) / first["rss"],
            "max_growth": (peak - first["rss"]) / first["rss"]}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# clients


def plan(client: int, cfg: SoakConfig, rng: random.Random, max_prompt: int) -> Request:
    """The next request of ``client``: endpoint, prompt length (log-uniform), max_tokens, abort point."""
    length = int(round(math.exp(rng.uniform(math.log(cfg.min_prompt), math.log(max_prompt)))))
    max_tokens = rng.randint(cfg.max_tokens_lo, cfg.max_tokens_hi)
    abort_at = rng.randint(1, max_tokens - 1) if rng.random() < cfg.abort_fraction and max_tokens > 1 else None
    endpoint = "chat" if rng.random() < cfg.chat_fraction else "completions"
    return Request(client, endpoint, length, max_tokens, abort_at)


def request_body(req: Request, model: str, prompts: Prompts) -> tuple[str, dict[str, Any]]:
    """The route and JSON body of ``req``: streamed, with usage in every chunk."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.8, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    if req.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": prompts.chat_messages(req.target_prompt)}
    return "/v1/completions", {**body, "prompt": prompts.token_prompt(req.target_prompt), "ignore_eos": True}


async def run_request(session: Any, base: str, model: str, req: Request, prompts: Prompts, t0: float,
                      cfg: SoakConfig) -> Request:  # fmt: skip
    """Send ``req``, read its stream (closing it at ``abort_at``), fill in its outcome and figures."""
    import aiohttp

    route, body = request_body(req, model, prompts)
    submit = time.monotonic()
    req.start = submit - t0
    chunks: list[tuple[float, int]] = []
    done, usage = False, None
    try:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=cfg.request_timeout_s)
        async with session.post(base + route, json=body, timeout=timeout) as resp:
            if resp.status != 200:
                req.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return req
            seen = 0
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    req.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return req
                usage = event.get("usage") or usage
                count = (usage or {}).get("completion_tokens", seen)
                chunks.append((time.monotonic(), count - seen))
                seen = count
                for choice in event.get("choices") or ():
                    req.finish_reason = choice.get("finish_reason") or req.finish_reason
                if req.abort_at is not None and seen >= req.abort_at and req.finish_reason is None:
                    resp.close()  # go away mid-stream: vLLM aborts the request
                    req.outcome = "aborted"
                    break
    except asyncio.CancelledError:
        req.outcome = "cut"
        raise
    except TimeoutError:
        req.error = f"read timeout ({cfg.request_timeout_s:.0f} s without data)"
    except Exception as exc:  # every failure is a counted error, never a crash of the soak
        req.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        figures = request_figures(submit, chunks)
        req.tokens, req.ttft_s, req.e2e_s, req.itl_s = (figures["output_tokens"], figures["ttft_s"],
                                                         figures["e2e_s"], figures["itl_s"])  # fmt: skip
        if usage:
            req.prompt_tokens = usage.get("prompt_tokens")
    if req.outcome == "aborted" or req.error is not None:
        return req
    if not done:
        req.error = "stream ended without [DONE]"
    elif req.finish_reason not in ("stop", "length"):
        req.error = f"finish_reason {req.finish_reason!r}"
    elif usage is None or usage.get("completion_tokens") != req.tokens:
        req.error = f"usage {usage} disagrees with {req.tokens} streamed tokens"
    elif req.endpoint == "completions" and req.tokens != req.max_tokens:
        req.error = f"{req.tokens} tokens with ignore_eos and max_tokens {req.max_tokens}"
    else:
        req.outcome = "completed"
    return req


async def client_loop(i: int, session: Any, base: str, model: str, cfg: SoakConfig, prompts: Prompts,
                      max_prompt: int, t0: float, deadline: float, results: list[Request]) -> None:  # fmt: skip
    """Client ``i``: requests one after the other until ``deadline`` (after a ramp-up delay)."""
    rng = random.Random(cfg.seed * 100_003 + i)
    await asyncio.sleep(cfg.ramp_s * i / max(1, cfg.clients))
    while time.monotonic() < deadline:
        req = plan(i, cfg, rng, max_prompt)
        results.append(req)
        await run_request(session, base, model, req, prompts, t0, cfg)


# ----------------------------------------------------------------------------------------------------------
# metrics


def _num_blocks(m: dict[str, float]) -> int | None:
    for key in m:
        if key.startswith("vllm:cache_config_info"):
            found = re.search(r'num_gpu_blocks="(\d+)"', key)
            if found:
                return int(found.group(1))
    return None


def counters(m: dict[str, float]) -> dict[str, float]:
    """The cumulative series of a scrape (counters, histogram counts), bucket lines left out."""
    return {k: v for k, v in m.items()
            if (k.split("{")[0].endswith(("_total", "_count"))) and "_created" not in k}  # fmt: skip


def settle(base: str, timeout: float) -> tuple[dict[str, float], float, bool]:
    """Scrape until no request runs or waits, no KV block is in use, and two scrapes 1 s apart agree on every
    counter (the workers fold their metrics every 0.25 s); the last scrape, the seconds waited, and whether it
    settled before ``timeout``. A scrape that fails or times out (a server starved of CPU can take longer than
    the scrape's 10 s) is retried until ``timeout``; only when none succeeded does it raise."""
    start = time.monotonic()
    previous: dict[str, float] | None = None
    m: dict[str, float] | None = None
    while True:
        try:
            m = scrape(base)
        except OSError as exc:  # URLError, timeouts, refused connections
            if time.monotonic() - start > timeout:
                if m is None:
                    raise RuntimeError(f"no /metrics scrape succeeded within {timeout:.0f} s: {exc}") from exc
                return m, time.monotonic() - start, False
            previous = None
            time.sleep(1.0)
            continue
        idle = (m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
                and m.get("vllm:kv_cache_usage_perc", 0) == 0)  # fmt: skip
        if idle and previous is not None and counters(previous) == counters(m):
            return m, time.monotonic() - start, True
        if time.monotonic() - start > timeout:
            return m, time.monotonic() - start, False
        previous = m if idle else None
        time.sleep(1.0)


def server_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the run added to each counter that changed."""
    a, b = counters(after), counters(before)
    return {k: v - b.get(k, 0.0) for k, v in sorted(a.items()) if v != b.get(k, 0.0) and "_bucket" not in k}


def _sum(delta: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in delta.items() if k.startswith(prefix))


# ----------------------------------------------------------------------------------------------------------
# the run


async def _run_clients(base: str, model: str, cfg: SoakConfig, prompts: Prompts, max_prompt: int,
                       pgid: int | None, log: Any) -> tuple[list[Request], list[dict[str, float]], float]:  # fmt: skip
    import aiohttp

    results: list[Request] = []
    samples: list[dict[str, float]] = []
    t0 = time.monotonic()
    deadline = t0 + cfg.duration_s
    stop_sampling = asyncio.Event()

    async def sampler() -> None:
        last_report = 0.0
        while not stop_sampling.is_set():
            if pgid is not None:
                rss, procs = await asyncio.to_thread(group_rss, pgid)
                samples.append({"t": time.monotonic() - t0, "rss": rss, "processes": procs})
            now = time.monotonic() - t0
            if now - last_report >= 60:
                last_report = now
                counts = {o: sum(r.outcome == o and (o != "error" or r.error is not None) for r in results)
                          for o in OUTCOMES}  # fmt: skip
                rss_text = f", server RSS {samples[-1]['rss'] / 2**20:.0f} MiB" if samples else ""
                log(f"soak: {now:6.0f} s: {len(results)} requests started, {counts}{rss_text}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_sampling.wait(), cfg.rss_interval_s)

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        sampling = asyncio.create_task(sampler())
        tasks = [asyncio.create_task(client_loop(i, session, base, model, cfg, prompts, max_prompt, t0, deadline,
                                                 results)) for i in range(cfg.clients)]  # fmt: skip
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        _, pending = await asyncio.wait(tasks, timeout=cfg.drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        clients_done = time.monotonic() - t0
        if pgid is not None:  # the last sample under load
            rss, procs = group_rss(pgid)
            samples.append({"t": clients_done, "rss": rss, "processes": procs})
        stop_sampling.set()
        await sampling
    return results, samples, clients_done


def model_shape(root: str | None) -> list[int] | None:
    """(layers, query heads) from the served model's ``config.json`` when its folder is on this machine."""
    config = Path(root or "") / "config.json"
    if not root or not config.is_file():
        return None
    c = json.loads(config.read_text())
    return [int(c["num_hidden_layers"]), int(c["num_attention_heads"])]


def run_soak(base: str, cfg: SoakConfig, server_pgid: int | None = None, log: Any = print) -> dict[str, Any]:
    """Run the soak against the server at ``base`` and return its report (see the module docstring).
    ``server_pgid``: the server's process group for RSS (default: the group of the process listening on
    ``base``'s port, when it runs on this machine)."""
    models = json.loads(http_get(base + "/v1/models"))["data"]
    model, max_model_len = models[0]["id"], int(models[0]["max_model_len"])
    shape = model_shape(models[0].get("root"))
    max_prompt = cfg.max_prompt or max_model_len - cfg.max_tokens_hi - cfg.margin_tokens
    if not cfg.min_prompt <= max_prompt <= max_model_len - cfg.max_tokens_hi:
        raise ValueError(f"prompt lengths {cfg.min_prompt}..{max_prompt} do not fit max_model_len {max_model_len} "
                         f"with max_tokens up to {cfg.max_tokens_hi}")  # fmt: skip
    if server_pgid is None:
        pid = listener_pid(base)
        server_pgid = os.getpgid(pid) if pid else None
    rng = random.Random(cfg.seed)
    prompts = Prompts(base, model, cfg, rng)
    # warm-up: one short request per endpoint (not counted), then the counters the run starts from
    for endpoint in ("completions", "chat"):
        route, body = request_body(Request(-1, endpoint, 16, 4, None), model, prompts)
        body = {k: v for k, v in body.items() if k != "stream_options"}
        http_post(base + route, {**body, "stream": False}, timeout=300)
    before, _, _ = settle(base, cfg.settle_timeout_s)
    log(f"soak: {cfg.clients} clients for {cfg.duration_s:.0f} s against {base} ({model}, max_model_len "
        f"{max_model_len}, prompts {cfg.min_prompt}..{max_prompt} tokens, max_tokens {cfg.max_tokens_lo}.."
        f"{cfg.max_tokens_hi}, abort fraction {cfg.abort_fraction})")  # fmt: skip
    wall0 = time.time()
    results, samples, clients_done = asyncio.run(_run_clients(base, model, cfg, prompts, max_prompt, server_pgid, log))
    after, settle_s, settled = settle(base, cfg.settle_timeout_s)
    settled_rss = group_rss(server_pgid)[0] if server_pgid is not None else None
    return report(cfg, results, samples, clients_done, before, after, settle_s, settled, settled_rss,
                  {"base": base, "model": model, "max_model_len": max_model_len, "max_prompt": max_prompt,
                   "started": wall0, "layers_heads": shape})  # fmt: skip


def report(cfg: SoakConfig, results: list[Request], samples: list[dict[str, float]], clients_done: float,
           before: dict[str, float], after: dict[str, float], settle_s: float, settled: bool,
           settled_rss: int | None, server: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The soak's JSON document: figures, server counters, leak check and the verdict per target."""
    by = {o: [r for r in results if r.outcome == o] for o in OUTCOMES}
    errors: dict[str, int] = {}
    for r in by["error"]:
        kind = re.sub(r"\d+", "N", r.error or "unknown")[:120]
        errors[kind] = errors.get(kind, 0) + 1
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    itl = [g for r in results for g in r.itl_s]
    tokens = sum(r.tokens for r in results)
    delta = server_delta(before, after)
    blocks = _num_blocks(after)
    usage = after.get("vllm:kv_cache_usage_perc")
    leaked = round(usage * blocks) if usage is not None and blocks is not None else None
    host_before, host_after = before.get("vllm:cert_host_tier_bytes"), after.get("vllm:cert_host_tier_bytes")
    rss = rss_summary(samples, cfg.warmup_fraction * cfg.duration_s, clients_done)
    gen = delta.get("vllm:generation_tokens_total", 0.0)
    completed_tokens = sum(r.tokens for r in by["completed"])
    unfinished_cap = sum(r.max_tokens for r in by["aborted"] + by["cut"] + by["error"])
    finished = {k.split('"')[1]: v for k, v in delta.items() if k.startswith("vllm:request_success_total{")}
    unfinished = by["aborted"] + by["cut"]
    # tokens the server generated for requests after their client had gone (vLLM counts no abort in
    # request_success_total; an honoured close shows as a small overrun, at most a step or two per close)
    overrun = gen - completed_tokens - sum(r.tokens for r in unfinished)
    head_steps = _sum(delta, "vllm:cert_head_steps_total")
    decode_steps = gen - sum(1 for r in results if r.tokens > 0)  # every token after a request's first
    shape = server.get("layers_heads")
    accounting = {
        "server_generation_tokens": gen,
        "client_tokens": tokens,
        "completed_tokens": completed_tokens,
        # the server generated at least what the clients received, and at most that plus what the unfinished
        # requests could still have generated after the client went away
        "generation_tokens_consistent": completed_tokens + sum(r.tokens for r in by["aborted"] + by["cut"])
        <= gen
        <= completed_tokens + unfinished_cap,
        "abort_overrun_tokens": overrun,
        "server_finished": finished,
        # every completed request finished by stop/length on the server; so may a closed one whose last tokens the
        # server generated before it saw the close (at most those needing no more tokens than the overrun)
        "finished_stop_length_accounted": len(by["completed"])
        <= finished.get("stop", 0) + finished.get("length", 0)
        <= len(by["completed"]) + sum(1 for r in unfinished if r.max_tokens - r.tokens <= max(overrun, 0)),
        "cert_head_steps": head_steps,
        # each generated token after a request's first is one certified decode step of every layer and query
        # head; a closed request may have run one more step whose token was never delivered (nor counted)
        "cert_head_steps_expected_min": decode_steps * shape[0] * shape[1] if shape else None,
        "cert_head_steps_extra_steps": (head_steps / (shape[0] * shape[1]) - decode_steps) if shape else None,
        "cert_head_steps_by_rung": {k[-3]: v for k, v in delta.items() if k.startswith("vllm:cert_head_steps_total")},
        "cert_exact_tokens": {k: v for k, v in delta.items() if k.startswith("vllm:cert_exact_tokens_total")},
        "cert_audits": _sum(delta, "vllm:cert_audits_total"),
        "cert_audit_violations": _sum(delta, "vllm:cert_audit_violations_total"),
        "cert_canary_violations": _sum(delta, "vllm:cert_canary_violations_total"),
        "preemptions": delta.get("vllm:num_preemptions_total", 0.0),
        "prompt_tokens": delta.get("vllm:prompt_tokens_total", 0.0),
        "prefix_cache_hits": delta.get("vllm:prefix_cache_hits_total", 0.0),
        "prefix_cache_queries": delta.get("vllm:prefix_cache_queries_total", 0.0),
    }
    leak = {"settled": settled, "settle_s": settle_s, "num_blocks": blocks, "kv_cache_usage_perc": usage,
            "leaked_blocks": leaked, "requests_running": after.get("vllm:num_requests_running"),
            "requests_waiting": after.get("vllm:num_requests_waiting"),
            "host_tier_bytes_before": host_before, "host_tier_bytes_after": host_after,
            # shadow pages are indexed by block id: a block not in use holds no live shadow page
            "leaked_shadow_pages": leaked if host_before == host_after else None,
            "rss_after_settle": settled_rss}  # fmt: skip
    targets = {
        "no_errors": len(by["error"]) == 0,
        "rss_flat": rss["growth"] is not None and rss["growth"] < cfg.rss_growth_limit,
        "no_leaked_blocks": settled and leaked == 0,
        "host_tier_unchanged": host_before is not None and host_before == host_after,
    }
    return {
        "schema": SCHEMA,
        "config": asdict(cfg),
        "server": server,
        "environment": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_end": os.getloadavg(),
        },  # fmt: skip
        "clients_done_s": clients_done,
        "requests": {o: len(v) for o, v in by.items()} | {"total": len(results)},
        "requests_by_endpoint": {e: sum(r.endpoint == e for r in results) for e in ("completions", "chat")},
        "errors": errors,
        "error_examples": [r.error for r in by["error"][:10]],
        "tokens_served": tokens,
        "tokens_per_s": tokens / clients_done if clients_done > 0 else None,
        "ttft_s": _quantiles(ttft),
        "itl_s": _quantiles(itl),
        "prompt_tokens_served": _quantiles([float(r.prompt_tokens) for r in results if r.prompt_tokens]),
        "rss": rss,
        "rss_samples": samples,
        "per_request": [{k: v for k, v in asdict(r).items() if k != "itl_s"} for r in results],
        "leak_check": leak,
        "accounting": accounting,
        "server_counters_delta": delta,
        "targets": targets,
        "passed": all(targets.values()),
    }


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values),
            "mean": sum(values) / len(values)}  # fmt: skip


def table(doc: dict[str, Any]) -> str:
    """The report as a Markdown table."""
    req, rss, leak, acc = doc["requests"], doc["rss"], doc["leak_check"], doc["accounting"]

    def q(key: str, scale: float = 1.0, unit: str = "s") -> str:
        v = doc[key]
        if v is None:
            return "—"
        return f"p50 {v['p50'] * scale:.3g} {unit}, p99 {v['p99'] * scale:.3g} {unit} (n {v['n']})"

    def mib(v: float | None) -> str:
        return "—" if v is None else f"{v / 2**20:,.0f} MiB"

    growth = "—" if rss["growth"] is None else f"{rss['growth'] * 100:+.2f} % (max {rss['max_growth'] * 100:+.2f} %)"
    cfg = doc["config"]
    rungs = ", ".join(f"{k}: {v:,.0f}" for k, v in acc["cert_head_steps_by_rung"].items())
    if acc["cert_head_steps_expected_min"] is not None:
        rungs += (
            f" (sum {acc['cert_head_steps']:,.0f}; decode tokens × layers × heads "
            f"{acc['cert_head_steps_expected_min']:,.0f}, extra steps {acc['cert_head_steps_extra_steps']:,.1f})"
        )
    rows = [
        (
            "clients × duration",
            f"{cfg['clients']} × {cfg['duration_s']:.0f} s (clients done at {doc['clients_done_s']:.0f} s)",
        ),  # fmt: skip
        (
            "requests",
            f"{req['total']}: {req['completed']} completed, {req['aborted']} aborted (deliberate), "
            f"{req['cut']} cut at the end, {req['error']} errors",
        ),  # fmt: skip
        ("errors by kind", ", ".join(f"{k}: {v}" for k, v in doc["errors"].items()) or "none"),
        (
            "tokens served",
            f"{doc['tokens_served']:,} ({doc['tokens_per_s'] or 0:.1f} tok/s); server generated "
            f"{acc['server_generation_tokens']:,.0f} (consistent: {acc['generation_tokens_consistent']}; "
            f"after a close: {acc['abort_overrun_tokens']:,.0f})",
        ),
        ("TTFT", q("ttft_s")),
        ("inter-token latency", q("itl_s", 1000, "ms")),
        (
            "server RSS",
            f"first after warm-up {mib(rss['first_after_warmup'])}, last {mib(rss['last'])}, "
            f"growth {growth}; after settling {mib(leak['rss_after_settle'])}",
        ),  # fmt: skip
        (
            "KV blocks in use after settling",
            f"{leak['leaked_blocks']} of {leak['num_blocks']} (settled: {leak['settled']} in {leak['settle_s']:.1f} s)",
        ),  # fmt: skip
        (
            "host tier (shadow pages)",
            f"{mib(leak['host_tier_bytes_before'])} → {mib(leak['host_tier_bytes_after'])}; "
            f"shadow pages in use {leak['leaked_shadow_pages']}",
        ),  # fmt: skip
        ("server: finished by reason", ", ".join(f"{k} {v:.0f}" for k, v in acc["server_finished"].items())),
        (
            "server: preemptions, prefix hits",
            f"{acc['preemptions']:.0f}, {acc['prefix_cache_hits']:,.0f} of {acc['prefix_cache_queries']:,.0f} tokens",
        ),  # fmt: skip
        ("certvllm: head-steps by rung", rungs),
        (
            "certvllm: audits, violations, canary",
            f"{acc['cert_audits']:.0f}, {acc['cert_audit_violations']:.0f}, {acc['cert_canary_violations']:.0f}",
        ),  # fmt: skip
    ]
    rows += [(f"target: {k}", "PASS" if v else "FAIL") for k, v in doc["targets"].items()]
    return "\n".join(["| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--url", help="attach to this server instead of starting one")
    parser.add_argument("--model", default=str(SERVER_MODEL), help="model folder of the started server")
    parser.add_argument("--max-model-len", type=int, default=2048, help="of the started server")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of the started server")
    parser.add_argument("--cert-args", default="--cert-config default",
                        help="certvllm arguments of the started server (one string)")  # fmt: skip
    parser.add_argument("--serve-args", default="", help="further vLLM arguments of the started server")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--abort-fraction", type=float, default=0.1)
    parser.add_argument("--chat-fraction", type=float, default=0.5)
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=None,
                        help="longest prompt (default max_model_len − max max_tokens − 32)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, nargs=2, default=[16, 128], metavar=("LO", "HI"))
    parser.add_argument("--warmup-fraction", type=float, default=0.2)
    parser.add_argument("--rss-interval-s", type=float, default=5.0)
    parser.add_argument("--rss-growth-limit", type=float, default=0.05)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--drain-s", type=float, default=120.0)
    parser.add_argument("--settle-timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default runs/soak_<time>.json)")
    args = parser.parse_args(argv)
    cfg = SoakConfig(clients=args.clients, duration_s=args.minutes * 60, abort_fraction=args.abort_fraction,
                     chat_fraction=args.chat_fraction, min_prompt=args.min_prompt, max_prompt=args.max_prompt,
                     max_tokens_lo=args.max_tokens[0], max_tokens_hi=args.max_tokens[1],
                     warmup_fraction=args.warmup_fraction, rss_interval_s=args.rss_interval_s,
                     request_timeout_s=args.request_timeout_s, drain_s=args.drain_s,
                     settle_timeout_s=args.settle_timeout_s, seed=args.seed,
                     rss_growth_limit=args.rss_growth_limit)  # fmt: skip
    out = args.out or ROOT / "runs" / f"soak_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    if args.url:
        doc = run_soak(args.url.rstrip("/"), cfg, log=log)
    else:
        from certvllm.models import prepare_default_model

        if Path(args.model).resolve() == SERVER_MODEL.resolve():
            prepare_default_model(SERVER_MODEL)
        port = free_port()
        cmd = certified_serve_command(port, model=Path(args.model), served_name=SERVED_NAME,
                                      max_model_len=args.max_model_len, cert_args=tuple(args.cert_args.split()),
                                      extra=tuple(args.serve_args.split()))  # fmt: skip
        server_log = out.with_name(out.stem + "_serve.log")
        log(f"soak: starting {' '.join(cmd)} (log: {server_log})")
        started = time.monotonic()
        with serving(cmd, port, serve_env(args.kv_cache_gib), server_log, start_timeout=300) as (base, proc):
            log(f"soak: server ready in {time.monotonic() - started:.0f} s")
            doc = run_soak(base, cfg, server_pgid=proc.pid, log=log)
        doc["server"].update(command=cmd, kv_cache_gib=args.kv_cache_gib, log=str(server_log))
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    print(f"\nwritten: {out}")
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
