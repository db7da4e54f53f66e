"""One vLLM engine on a GPU with a given --kv-cache-dtype: start-up time, KV capacity, a batch of long
prompts, tokens/s and the certvllm metrics. A smoke run of the CUDA path inside vLLM, not a benchmark.

Usage: python benchmarks/vllm_gpu_smoke.py MODEL_DIR --kv-cache-dtype certified [--prompt-len 8192 --batch 4]
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--kv-cache-dtype", default="certified")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--host-memory-gb", type=float, default=48.0)
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    extra = {}
    if args.kv_cache_dtype == "certified":
        extra["additional_config"] = {"certvllm": {"host_memory_gb": args.host_memory_gb}}
    t0 = time.time()
    llm = LLM(args.model, load_format="dummy", kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.eager, max_num_seqs=64,
              **extra)  # fmt: skip
    start_s = time.time() - t0
    cfg = llm.llm_engine.vllm_config.cache_config
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 40000 + 100 for j in range(args.prompt_len)]}
               for i in range(args.batch)]  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    t1 = time.time()
    outs = llm.generate(prompts, params)
    gen_s = time.time() - t1
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"kv_cache_dtype": args.kv_cache_dtype, "start_s": round(start_s, 1),
                      "num_gpu_blocks": cfg.num_gpu_blocks, "block_size": cfg.block_size,
                      "kv_tokens": (cfg.num_gpu_blocks or 0) * cfg.block_size, "generate_s": round(gen_s, 2),
                      "output_tokens": tokens, "first_tokens": outs[0].outputs[0].token_ids[:8]}))  # fmt: skip


if __name__ == "__main__":
    main()
