"""Certified attention over the paged tiered cache: the op the vLLM backend calls.

Each *row* is one query per head with its own context: tokens ``[0, seq_len)`` of the blocks in
its block-table row. A decode batch has one row per sequence; a prefill chunk that reads cached
blocks has one row per query token (rows then share a block table with growing lengths).

Per row, in order (rows are processed together, vectorized over KV heads, query heads and blocks):

1. phase 1: INT8 scores of every full block → block log-masses, Δ_b, rounding R;
   the trailing partial block is scored exactly from its shadow page;
2. selection: top-K* key blocks per query head, rung 1, rung 2 (``selection.py``);
3. page-in of the union of promoted (block, KV head) pages from the shadow tier;
4. phase 2: one softmax over all tokens with unquantized keys/values where promoted and INT8 keys /
   INT4 values elsewhere; per-block weight sums give the masses the bounds need;
5. bounds E_key, E_val per head (``certvllm.bounds``); checks (``checks.py``);
6. exact dense attention for escalated heads (rung 3) and rows (rung 4) (``dense.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from certvllm.attention import cpu_fused
from certvllm.attention.checks import canary_violations, rank_and_boundary
from certvllm.attention.dense import dense_paged
from certvllm.attention.report import (
    RUNG_HEAD_DENSE,
    RUNG_LAYER_DENSE,
    RUNG_VALUES,
    RUNG_WIDEN,
    CertifiedOutput,
    CertReport,
)
from certvllm.attention.selection import Phase1, select_keys, select_values
from certvllm.bounds import (
    alpha_inflation,
    block_delta,
    exp_rounding,
    key_bound,
    key_sum_bound,
    score_rounding,
    tail_mass_upper,
    value_bound,
)
from certvllm.config import CertConfig
from certvllm.formats.pages import PageReader
from certvllm.kv.cache import LayerKVCache
from certvllm.kv.pagein import PageInEngine

NEG_INF = float("-inf")
DenseFn = Callable[[list[int]], torch.Tensor]
ROW_CHUNK_ELEMENTS = 1 << 24
"""Rows are processed in chunks so that the largest intermediate stays near 64 MiB."""

_READERS: dict[tuple[int, int], PageReader] = {}


def _reader(cache: LayerKVCache) -> PageReader:
    key = (cache.layout.head_dim, cache.layout.value_group)
    if key not in _READERS:
        _READERS[key] = PageReader(cache.layout)
    return _READERS[key]


@contextlib.contextmanager
def _exact_float32() -> Iterator[None]:
    """Full-precision float32 matmuls (no TF32/bf16 shortcuts): the rounding terms assume it."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def finite_abs_max(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Largest finite |x| over ``dims`` (0 where none is finite)."""
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax(dim=dims)


def validate_shapes(q: torch.Tensor, cache: LayerKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Shape checks of a certified call (no tensor values are read)."""
    if q.dim() != 3 or q.shape[-1] != cache.layout.head_dim:
        raise ValueError(f"Invalid shape of q: expected [R, H_q, {cache.layout.head_dim}], got {list(q.shape)}")
    if q.shape[1] % cache.num_kv_heads != 0:
        raise ValueError(f"H_q={q.shape[1]} is not a multiple of H_kv={cache.num_kv_heads}; GQA needs whole groups")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or seq_lens.shape != (q.shape[0],):
        raise ValueError(
            f"Invalid block_tables {list(block_tables.shape)} / seq_lens {list(seq_lens.shape)} for {q.shape[0]} rows"
        )


def _validate(q: torch.Tensor, cache: LayerKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    validate_shapes(q, cache, block_tables, seq_lens)
    if seq_lens.numel() and int(seq_lens.min()) < 1:
        raise ValueError("every row needs seq_len ≥ 1 (a query attends to at least itself)")
    need = -(-int(seq_lens.max()) // cache.layout.block_size) if seq_lens.numel() else 0
    if need > block_tables.shape[1]:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns but a row needs {need} blocks")


def certified_attention(
    q: torch.Tensor,
    cache: LayerKVCache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    config: CertConfig,
    scale: float | None = None,
    pagein: PageInEngine | None = None,
    generator: torch.Generator | None = None,
    dense_fn: DenseFn | None = None,
) -> CertifiedOutput:
    """Certified attention for a batch of rows over one layer's paged cache.

    Args:
        q: ``[R, H_q, D]`` queries (any float dtype; post-RoPE).
        cache: the layer's tiered cache.
        block_tables: ``[R, max_blocks]`` int physical block ids per row.
        seq_lens: ``[R]`` int context length per row (tokens ``[0, seq_len)``, the query's own included).
        config: tolerances and mode.
        scale: softmax scale, default ``1/√D``.
        pagein: the page-in engine (counts traffic); a CPU one is made if omitted.
        generator: random source for exploration draws.
        dense_fn: exact attention for a list of row indices → ``[n, H_q, D]`` float32 (rungs 3/4 and
            the dense mode). An engine passes its own dense kernel run on the shadow tier, so that a
            recomputed head is exactly what that engine's unquantized cache would give; the default
            is :func:`certvllm.attention.dense.dense_paged`.

    Returns:
        ``out`` ``[R, H_q, D]`` float32 and a ``[R, H_q]`` :class:`CertReport`.
    """
    if cache.pages.device.type == "cuda":  # Triton kernels, no host synchronisation: certvllm.attention.gpu
        from certvllm.attention.gpu import certified_attention_gpu

        return certified_attention_gpu(q, cache, block_tables, seq_lens, config, scale, pagein, generator, dense_fn)
    seq_lens = seq_lens.to("cpu", torch.int64)
    block_tables = block_tables.to("cpu", torch.int64)
    _validate(q, cache, block_tables, seq_lens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    pagein = pagein or PageInEngine(cache.pages.device)
    if dense_fn is None:
        lens_list = seq_lens.tolist()
        dense_fn = lambda rows: dense_paged(q, cache, block_tables, lens_list, rows, scale, pagein)  # noqa: E731
    rows = q.shape[0]
    if config.mode == "dense":
        report = CertReport.zeros(rows, q.shape[1], cache.pages.device)
        report.rung.fill_(RUNG_LAYER_DENSE)
        with _exact_float32():
            return CertifiedOutput(dense_fn(list(range(rows))).float(), report)

    if cpu_fused.supported(cache, config):
        with _exact_float32():
            out, report = cpu_fused.certified_rows(q, cache, block_tables, seq_lens, config, scale, pagein, generator)
            _apply_dense_fallbacks(out, report, dense_fn)
        return CertifiedOutput(out, report)

    outs, reports = [], []
    per_row = max(1, int(seq_lens.max()) // cache.layout.block_size) * cache.layout.head_dim * q.shape[1] * 16
    step = max(1, ROW_CHUNK_ELEMENTS // per_row)
    with _exact_float32():
        for start in range(0, rows, step):
            sl = slice(start, start + step)
            out, report = _certified_rows(
                q[sl], cache, block_tables[sl], seq_lens[sl], config, scale, pagein, generator
            )
            outs.append(out)
            reports.append(report)
        out, report = torch.cat(outs), CertReport.cat(reports)
        _apply_dense_fallbacks(out, report, dense_fn)
    return CertifiedOutput(out, report)


def _apply_dense_fallbacks(out: torch.Tensor, report: CertReport, dense_fn: DenseFn) -> None:
    """Rungs 3/4: replace escalated heads by exact dense attention; their bounds become 0."""
    exact = report.rung >= RUNG_HEAD_DENSE
    rows = exact.any(dim=1).nonzero().flatten().tolist()
    if not rows:
        return
    dense = dense_fn(rows).float()
    idx = torch.tensor(rows, device=out.device)
    sel = exact[idx].unsqueeze(-1)
    out[idx] = torch.where(sel, dense.to(out.device), out[idx])
    for t in (report.e_key, report.e_val, report.e_round):
        t.masked_fill_(exact, 0.0)


def _certified_rows(
    q: torch.Tensor,
    cache: LayerKVCache,
    tables: torch.Tensor,
    lens: torch.Tensor,
    cfg: CertConfig,
    scale: float,
    pagein: PageInEngine,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, CertReport]:
    """Phases 1–2, bounds and checks for a chunk of rows; dense fallbacks are applied by the caller."""
    R, Hq, D = q.shape
    K = cache.num_kv_heads
    G = Hq // K
    N = cache.layout.block_size
    dev = cache.pages.device
    certified = cfg.mode == "certified"

    nfull = lens // N
    ntail = lens % N
    B = max(1, int(nfull.max()))
    qs = (q.to(dev).float() * scale).view(R, K, G, D)
    q_abs = qs.abs()

    # ---- trailing partial block: exact keys and values from the shadow
    has_tail = ntail > 0
    tail_ids = tables.gather(1, nfull.clamp(max=tables.shape[1] - 1).unsqueeze(1)).squeeze(1)
    tail_k = torch.zeros(R, K, N, D, device=dev)
    tail_v = torch.zeros(R, K, N, D, device=dev)
    if bool(has_tail.any()):
        part = pagein.gather_blocks(cache, tail_ids[has_tail]).float()  # (t, H_kv, 2, N, D)
        tail_k[has_tail.to(dev)] = part[:, :, 0]
        tail_v[has_tail.to(dev)] = part[:, :, 1]
    tok_valid = (torch.arange(N) < ntail.unsqueeze(1)).to(dev)  # (R, N)
    live = tok_valid[:, None, :, None]  # stale rows of a reused block must not enter any bound
    tail_k = torch.where(live, tail_k, torch.zeros_like(tail_k))
    tail_v = torch.where(live, tail_v, torch.zeros_like(tail_v))
    s_tail = torch.einsum("rkgd,rknd->rkgn", qs, tail_k).masked_fill(~tok_valid[:, None, None, :], NEG_INF)
    tail_round = score_rounding(q_abs, tail_k.abs().amax(dim=2).unsqueeze(1)).squeeze(-1)  # (R, K, G)
    tail_vnorm = (torch.linalg.vector_norm(tail_v.double(), dim=-1).amax(dim=-1) * (1 + 2.0**-20)).float()

    # ---- full blocks: phase 1 on the INT8 keys
    ids = tables[:, :B].clamp(0, cache.num_blocks - 1)
    bvalid = (torch.arange(B) < nfull.unsqueeze(1)).to(dev)  # (R, B)
    valid4 = bvalid[:, None, None, :]
    dec = _reader(cache).decode(cache.read_pages(ids))  # keys (R, B, K, N, D)
    s8 = torch.einsum("rkgd,rbknd->rkgbn", qs, dec.keys).masked_fill(~valid4.unsqueeze(-1), NEG_INF)
    delta = block_delta(q_abs, dec.sigma).masked_fill(~valid4, 0.0)
    rnd = score_rounding(q_abs, dec.key_mag).masked_fill(~valid4, 0.0)
    eta = dec.eta.permute(0, 2, 1).masked_fill(~bvalid[:, None, :], 0.0).unsqueeze(2)  # (R, K, 1, B)
    nu = dec.nu.permute(0, 2, 1).masked_fill(~bvalid[:, None, :], 0.0)
    bad_page = ((dec.violated | ~dec.valid) & bvalid.unsqueeze(-1)).any(dim=(1, 2))  # (R,)

    v_max = torch.maximum(nu.amax(dim=-1), tail_vnorm).unsqueeze(-1)  # (R, K, 1)
    eta_max = eta.amax(dim=-1)  # (R, K, 1)
    score_abs1 = torch.maximum(finite_abs_max(s8, (-1, -2)), finite_abs_max(s_tail, (-1,)))
    base_round = torch.maximum(rnd.amax(dim=-1), tail_round)
    round1 = base_round + exp_rounding(score_abs1)

    l8 = torch.logsumexp(s8, dim=-1)
    l_tail = torch.logsumexp(s_tail, dim=-1)
    lse = torch.logsumexp(torch.cat((l8, l_tail.unsqueeze(-1)), dim=-1), dim=-1, keepdim=True)
    ph1 = Phase1(
        log_mass=l8, mass=torch.exp(l8 - lse), delta=delta, rounding=round1, valid=valid4,
        num_full=nfull.to(dev).view(R, 1, 1), v_max=v_max, eta=eta,
    )  # fmt: skip

    # ---- selection (rungs 1 and 2)
    if certified:
        key_mask, widened = select_keys(ph1, cfg, generator)
        value_mask = select_values(ph1, key_mask, cfg)
    else:
        key_mask = torch.zeros_like(s8[..., 0], dtype=torch.bool)
        value_mask = key_mask
        widened = key_mask[..., 0]

    # ---- page-in of the union of promoted pages, exact scores there
    union = (key_mask | value_mask).any(dim=2)  # (R, K, B)
    r_i, k_i, b_i = union.nonzero(as_tuple=True)
    s2 = s8
    canary_row = torch.zeros(R, dtype=torch.bool, device=dev)
    items_v = None
    if r_i.numel():
        items = pagein.gather_kv(cache, ids[r_i.cpu(), b_i.cpu()], k_i.cpu()).float()  # (n, 2, N, D)
        items_k, items_v = items[:, 0], items[:, 1]
        pagein.count_promotions(int(key_mask.any(2).sum()), int(value_mask.any(2).sum()))
        s_items = torch.einsum("ngd,nsd->ngs", qs[r_i, k_i], items_k)
        s16 = s8.clone()
        s16[r_i, k_i, :, b_i] = s_items
        s2 = torch.where(key_mask.unsqueeze(-1), s16, s8)
        if certified and cfg.canary:
            bad = canary_violations(s_items, s8[r_i, k_i, :, b_i], delta[r_i, k_i, :, b_i], round1[r_i, k_i])
            canary_row[r_i[bad]] = True

    # ---- phase 2: one softmax over every token
    m = torch.maximum(s2.amax(dim=(-1, -2)), s_tail.amax(dim=-1))  # (R, K, G)
    w = torch.exp(s2 - m[..., None, None])
    w_tail = torch.exp(s_tail - m.unsqueeze(-1))
    den_b = w.sum(dim=-1)  # (R, K, G, B)
    num_b = torch.einsum("rkgbn,rbknd->rkgbd", w, dec.values)
    if items_v is not None and bool(value_mask.any()):
        num16 = num_b.clone()
        num16[r_i, k_i, :, b_i] = torch.einsum("ngs,nsd->ngd", w[r_i, k_i, :, b_i], items_v)
        num_b = torch.where(value_mask.unsqueeze(-1), num16, num_b)
    den_t = w_tail.sum(dim=-1)
    num = num_b.double().sum(dim=-2) + torch.einsum("rkgn,rknd->rkgd", w_tail, tail_v).double()
    den = den_b.double().sum(dim=-1) + den_t.double()
    out = (num / den.unsqueeze(-1)).float().reshape(R, Hq, D)

    # ---- bounds on the output actually computed
    rho = den_b.double() / den.unsqueeze(-1)
    e_val = value_bound(torch.where(valid4 & ~value_mask, rho, torch.zeros_like(rho)), eta, N)
    in_tail = valid4 & ~key_mask
    alpha = (torch.where(in_tail, rho, torch.zeros_like(rho)).sum(dim=-1) * alpha_inflation(N)).float()
    delta_tail = torch.where(in_tail, delta, torch.zeros_like(delta)).amax(dim=-1)
    score_abs2 = torch.maximum(finite_abs_max(s2, (-1, -2)), finite_abs_max(s_tail, (-1,)))
    round2 = base_round + exp_rounding(score_abs2)
    alpha_up = tail_mass_upper(alpha, delta_tail, round2)
    e_key, e_round = key_bound(v_max, key_sum_bound(alpha_up, delta_tail, round2), eta_max, N)

    # ---- checks
    report = CertReport.zeros(R, Hq, dev)
    flat = lambda x: x.reshape(R, Hq)  # noqa: E731
    if certified and cfg.rank_check:
        exact_lm = torch.cat((m.unsqueeze(-1) + torch.log(den_b), (m + torch.log(den_t)).unsqueeze(-1)), -1)
        int8_lm = torch.cat((l8, l_tail.unsqueeze(-1)), dim=-1)
        tail_col = has_tail.to(dev)[:, None, None, None]
        in_f = torch.cat((key_mask, tail_col.expand(R, K, G, 1)), dim=-1)
        rank_fail, boundary_fail = rank_and_boundary(
            int8_lm, exact_lm, in_f, torch.cat((valid4, tail_col), dim=-1),
            torch.cat((delta, torch.zeros_like(delta[..., :1])), dim=-1), round2, cfg.rank_depth, cfg.eps_guard,
        )  # fmt: skip
        report.rank_fail = flat(rank_fail)
        report.boundary_fail = flat(boundary_fail)
    v_max_h = v_max.expand(R, K, G)
    bound = e_key + e_val
    bound_fail = ~(bound <= cfg.bound_tol * v_max_h) | ~torch.isfinite(bound)  # NaN/inf bounds escalate
    precondition = bad_page.view(R, 1).expand(R, Hq)

    report.e_key, report.e_val, report.e_round = flat(e_key), flat(e_val), flat(e_round.expand(R, K, G))
    report.k_star = flat(key_mask.sum(dim=-1).to(torch.int32))
    report.v_promoted = flat(value_mask.sum(dim=-1).to(torch.int32))
    report.v_max = flat(v_max_h).contiguous()
    report.delta_tail = flat(delta_tail)
    report.alpha_tail = flat(alpha_up)
    report.precondition = precondition.clone()
    rung = torch.zeros(R, Hq, dtype=torch.int8, device=dev)
    rung[flat(widened)] = RUNG_WIDEN
    rung[report.v_promoted > 0] = RUNG_VALUES
    if certified:
        report.bound_fail = flat(bound_fail)
        report.canary_fail = canary_row.view(R, 1).expand(R, Hq).clone()
        head_dense = report.rank_fail | report.boundary_fail | report.bound_fail
        rung[head_dense] = RUNG_HEAD_DENSE
        rung[report.canary_fail | precondition] = RUNG_LAYER_DENSE
        if cfg.force_fallback != "none":
            rung.fill_(RUNG_HEAD_DENSE if cfg.force_fallback == "head" else RUNG_LAYER_DENSE)
    else:
        # naive mode never falls back; a broken precondition leaves the output without a bound
        unbounded = precondition | ~torch.isfinite(report.bound)
        report.e_key = torch.where(unbounded, torch.full_like(report.e_key, float("inf")), report.e_key)
    report.rung = rung
    return out, report
