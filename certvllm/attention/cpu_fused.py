"""Certified rows through the compiled CPU kernel (``csrc/cpu/certified_decode.cpp``).

Same algorithm, same certificate and same report as the torch reference (``reference.py``), fused into one
pass per (row, KV head) in C++ up to the head-level rungs; the row-wide end of the ladder is
``epilogue.finish_rungs``. Used on the CPU whenever the kernel is built (exploration draws are made here
and passed in).
"""

from __future__ import annotations

import torch

from certvllm.attention.call import LayerCall
from certvllm.attention.epilogue import NORM_ROUND_UP, finish_rungs
from certvllm.attention.selection import VALUE_BUDGET_MARGIN
from certvllm.bounds import (
    GAMMA_SLACK,
    alpha_inflation,
    delta_factor,
    exp_factors,
    round_factor,
    rounding_factor,
    value_inflation,
)
from certvllm.bounds.report import CertReport
from certvllm.config import CertConfig
from certvllm.formats.layout import key_scale_lut
from certvllm.kernels import cpu as cpu_kernel
from certvllm.kv.cache import LayerKVCache

_LUT = key_scale_lut()


def supported(cache: LayerKVCache, cfg: CertConfig) -> bool:
    """The fused kernel serves CPU pages in certified and naive mode."""
    return cache.pages.device.type == "cpu" and cfg.mode in ("certified", "naive") and cpu_kernel.available()


def certified_rows(call: LayerCall) -> tuple[torch.Tensor, CertReport]:
    """The call's rows → ``(out [R, H_q, D] float32, report [R, H_q])`` (rungs 3/4 not applied)."""
    q, cache, tables, lens, cfg, pagein = call.q, call.cache, call.tables, call.lens, call.cfg, call.pagein
    R, Hq, D = q.shape
    K = cache.num_kv_heads
    lay = cache.layout
    n = lay.block_size
    qs = (q.float() * call.scale).view(R, K, Hq // K, D).contiguous()
    layout = [lay.page_bytes, lay.v_codes, lay.v_scale, lay.v_zero, lay.k_offset, lay.k_scale_code, lay.header,
              lay.groups]  # fmt: skip
    c1, c0 = exp_factors()
    lad = cfg.ladder
    consts = [
        delta_factor(D), rounding_factor(D), c0, c1, GAMMA_SLACK, round_factor(n),
        value_inflation(n) * NORM_ROUND_UP, alpha_inflation(n), NORM_ROUND_UP, VALUE_BUDGET_MARGIN,
        lad.tau_cov, lad.rung1_tail_threshold, lad.key_tol, lad.v_tol, lad.bound_tol, lad.eps_guard,
    ]  # fmt: skip
    policy = [
        int(lad.certified), int(lad.rank_check), int(lad.canary), lad.k_min, lad.k_max, lad.k_max_widened,
        lad.value_k_max, lad.rank_depth, 0, int(lad.key_budget),
    ]  # fmt: skip
    explore = torch.zeros(0, dtype=torch.uint8)
    if lad.certified and lad.exploration_rate > 0:  # Bernoulli draws as in selection.select_keys
        blocks = max(1, int(lens.max()) // n)
        draw = torch.rand((R, K, Hq // K, blocks), generator=call.generator)
        explore = (draw < lad.exploration_rate).to(torch.uint8)
    res = cpu_kernel.load().certified_decode_cpu(
        qs, cache.pages, cache.shadow, cache.keys_channel_major, tables.contiguous(), lens.contiguous(), _LUT,
        layout, consts, policy, explore,
    )  # fmt: skip
    out, rung, e_key, e_val, e_round, k_star, v_prom, v_max, d_tail, a_tail = res[:10]
    rank, boundary, bound, flags, counters = res[10:]
    precondition = flags[:, 0:1].expand(R, Hq).clone()
    canary = flags[:, 1:2].expand(R, Hq).clone()
    pages_in, key_pages, value_pages, read_ns, threads = counters.tolist()
    pagein.stats.bytes += pages_in * 2 * n * D * cache.shadow.element_size()
    pagein.stats.seconds += read_ns / max(1, min(threads, R * K)) * 1e-9  # the reads ran on that many threads
    pagein.count_promotions(key_pages, value_pages)
    if not lad.certified:
        canary = torch.zeros_like(canary)
    report = CertReport(
        rung=rung, e_key=e_key, e_val=e_val, e_round=e_round, k_star=k_star, v_promoted=v_prom, v_max=v_max,
        delta_tail=d_tail, alpha_tail=a_tail, rank_fail=rank, boundary_fail=boundary, bound_fail=bound,
        canary_fail=canary, precondition=precondition,
    )  # fmt: skip
    report.rung, report.e_key = finish_rungs(rung, report, lad)
    return out, report
