"""What the CUDA write path costs per layer call of a prefill chunk: a chunk's tokens stored into the pinned host tier
(``triton_kernels.shadow_write``), then the blocks they complete encoded into tier-1 pages and their keys copied into
the write-through pool (``triton_kernels.encode.encode_completed_blocks``), at Llama-3.1-8B shapes (8 KV heads,
D = 128, float16; CUDA only).

Usage: python benchmarks/bench_write.py [--tokens 8192 16384] [--iters 20] [--out runs/write.json]

Each point times the encode launch alone, the whole write (``kv.cuda_pagein.write_tokens_on_device``) with the SM
stores, and with ``shadow_writes: copy_engine``'s copies (``kv.shadow_copy``): the time on the layer's stream, and
the time until the copies have landed (the stream fenced after them), median of
``--iters`` CUDA-event timings after two warm calls, on one cache whose shadow holds 2x the chunk. Prints a table and
writes the rows as JSON. (``profile_serving.py`` reports the same kernels inside vLLM.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_decode import HKV, D, release_cache, time_eager


def bench_point(tokens: int, iters: int) -> dict:
    from certvllm.triton_kernels.encode import encode_completed_blocks

    from certvllm.formats.layout import BLOCK_SIZE, PageLayout
    from certvllm.kv.cache import LayerKVCache
    from certvllm.kv.cuda_pagein import ensure_device_readable, write_tokens_on_device
    from certvllm.kv.host import allocate_host
    from certvllm.kv.promotion_cache import PromotionCache
    from certvllm.kv.shadow_copy import ShadowCopier, ShadowRun

    dev = torch.device("cuda")
    lay = PageLayout(D)
    blocks = 2 * tokens // BLOCK_SIZE + 1
    pages = torch.zeros(blocks, HKV, lay.page_bytes, dtype=torch.uint8, device=dev)
    shadow = allocate_host((blocks, HKV, 2, BLOCK_SIZE, D), torch.float16, pin=True)
    cache = LayerKVCache(pages, shadow, lay)
    pool = PromotionCache(cache, blocks * HKV)  # one slot per page: write-through, as served at 32K
    held = pool.write_through_tensors()
    g = torch.Generator(device=dev).manual_seed(tokens)
    kv = torch.randn(tokens, HKV, 3 * D, generator=g, device=dev).half()  # [T, H, k|v|other], as vLLM's qkv split
    key, value = kv[..., :D], kv[..., D : 2 * D]
    slots = torch.arange(BLOCK_SIZE, BLOCK_SIZE + tokens, device=dev, dtype=torch.int64)  # block 0 unused
    dev_shadow = ensure_device_readable(cache)

    def encode() -> None:
        encode_completed_blocks(cache.pages, dev_shadow, slots, lay, HKV, 1, cache.generation, held,
                                source=(key, value))  # fmt: skip

    def write() -> None:
        write_tokens_on_device(cache, key, value, slots, pool)

    copier = ShadowCopier(dev)
    runs = [ShadowRun(0, 1, tokens // BLOCK_SIZE)]  # shadow_writes: copy_engine, every block whole (ids 1 …)

    def write_copy_engine() -> None:
        write_tokens_on_device(cache, key, value, slots, pool, runs=runs, copier=copier)

    def write_copy_engine_landed() -> None:
        write_copy_engine()
        copier.fence()  # the layer's stream waits for the copies: what the write costs if nothing overlaps them

    row = {"tokens": tokens, "encode_ms": time_eager(encode, iters), "write_ms": time_eager(write, iters),
           "copy_engine_write_ms": time_eager(write_copy_engine, iters),
           "copy_engine_landed_ms": time_eager(write_copy_engine_landed, iters)}  # fmt: skip
    release_cache(cache)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("runs/write.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_write.py needs a CUDA device (the write path's kernels run there)")
    rows = [bench_point(t, args.iters) for t in args.tokens]
    print(f"device: {torch.cuda.get_device_name()}")
    print("| tokens | encode ms | whole write, SM stores ms | copy engine: layer's stream ms | copy engine: copies "
          "landed ms |\n|---|---|---|---|---|")  # fmt: skip
    for r in rows:
        print(f"| {r['tokens']} | {r['encode_ms']:.3f} | {r['write_ms']:.3f} | {r['copy_engine_write_ms']:.3f} | "
              f"{r['copy_engine_landed_ms']:.3f} |")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
