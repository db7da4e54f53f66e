"""End-to-end serving benchmark on the bundled model: ``--kv-cache-dtype certified`` versus ``auto``.

Same machine, same run, one engine per configuration (fresh process each): time to first token for a
~1K-token prompt (median of 3), decode throughput for one request (256 tokens) and for a batch of 4
(128 tokens each). The certified engine uses the default preset. Goal on CPU: certified ≥ 0.5× of
auto decode tokens/s.

Usage: python benchmarks/bench_e2e.py [--out runs/e2e.json] [--configs auto,certified]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

from certvllm.models import prepare_default_model
from certvllm.vllm_plugin.harness import run_engine

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "models" / "smollm2-135m-instruct")
SENTENCE = "The certified cache keeps every original key and value in host memory while the device holds pages. "
PROMPT_1K = SENTENCE * 52  # ≈ 1,000 tokens
DECODE = "Write a long story about a lighthouse keeper and the sea."


def phases() -> list[dict]:
    return [
        # distinct prompts, so no run is served from the prefix cache
        {"requests": [{"prompt": f"Document {i}. {PROMPT_1K}", "max_tokens": 1} for i in range(3)], "batch": False},
        {"requests": [{"prompt": DECODE, "max_tokens": 256, "ignore_eos": True}], "batch": False, "repeat": 2},
        {"requests": [{"prompt": f"{DECODE} Chapter {i}.", "max_tokens": 128, "ignore_eos": True} for i in range(4)],
         "repeat": 2},
    ]  # fmt: skip


def measure(kv_cache_dtype: str) -> dict:
    spec = {"model": MODEL, "kv_cache_dtype": kv_cache_dtype, "phases": phases(),
            "engine": {"max_model_len": 4096}}  # fmt: skip
    if kv_cache_dtype == "certified":
        spec["cert"] = {}
    res = run_engine(spec)
    ttft = statistics.median(res["phases"][0]["seconds"])
    single = min(res["phases"][1]["seconds"])
    batch = min(res["phases"][2]["seconds"])
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "ttft_s": ttft,
        "prompt_tokens": res["phases"][0]["outputs"][0]["prompt_tokens"],
        "decode_tok_s_batch1": 255 / max(single - ttft / 4, 1e-9),  # 256-token request: prefill is tiny
        "decode_tok_s_batch4": 4 * 128 / batch,
        "kv_cache_tokens": res["kv_cache_tokens"],
        "init_s": res["init_seconds"],
        "head_steps_by_rung": {k: v for k, v in res["metrics"].items() if k.startswith("vllm:cert_head_steps_total")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/e2e.json"))
    parser.add_argument("--configs", default="auto,certified")
    args = parser.parse_args()
    prepare_default_model(MODEL)
    rows = [measure(c) for c in args.configs.split(",")]
    base = rows[0]
    print(f"\n{'kv cache':<11}{'TTFT 1K (s)':>12}{'decode b=1 tok/s':>18}{'decode b=4 tok/s':>18}"
          f"{'ratio b=1':>11}{'ratio b=4':>11}{'KV tokens':>11}")  # fmt: skip
    for r in rows:
        b1, b4 = r["decode_tok_s_batch1"], r["decode_tok_s_batch4"]
        print(f"{r['kv_cache_dtype']:<11}{r['ttft_s']:>12.3f}{b1:>18.1f}{b4:>18.1f}"
              f"{b1 / base['decode_tok_s_batch1']:>11.2f}{b4 / base['decode_tok_s_batch4']:>11.2f}"
              f"{r['kv_cache_tokens'] or 0:>11,}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.machine(), "rows": rows}, indent=2))
    print(f"→ {args.out}")


if __name__ == "__main__":
    main()
