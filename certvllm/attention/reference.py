"""The torch reference of certified attention over the paged tiered cache: every other implementation
(the CPU kernel, the CUDA kernels) is tested against it.

Each *row* is one query per head with its own context: tokens ``[0, seq_len)`` of the blocks in its
block-table row. Per row, vectorized over KV heads, query heads and blocks:

1. phase 1: INT8 scores of every full block → block log-masses, Δ_b, rounding R; the trailing partial
   block is scored exactly from its shadow page (``epilogue.summarize``);
2. selection: top-K* key blocks per query head, rung 1, rung 2 (``selection.py``);
3. page-in of the union of promoted (block, KV head) pages from the shadow tier;
4. phase 2: one softmax over all tokens with unquantized keys/values where promoted and INT8 keys /
   INT4 values elsewhere; per-block weight sums give the masses the bounds need;
5. bounds, checks, rungs and report (``epilogue.certify``).

Rungs 3/4 are applied by the op (``op.py``).
"""

from __future__ import annotations

import torch

from certvllm.attention.call import LayerCall
from certvllm.attention.checks import canary_violations
from certvllm.attention.epilogue import Measured, certify, combine, finite_abs_max, summarize
from certvllm.attention.selection import Phase1, select_keys, select_values
from certvllm.bounds import block_delta, score_rounding
from certvllm.bounds.report import CertReport
from certvllm.formats.pages import PageReader
from certvllm.kv.cache import LayerKVCache

ROW_CHUNK_ELEMENTS = 1 << 24
"""Rows are processed in chunks so that the largest intermediate stays near 64 MiB."""

_READERS: dict[tuple[int, int], PageReader] = {}


def _reader(cache: LayerKVCache) -> PageReader:
    key = (cache.layout.head_dim, cache.layout.value_group)
    if key not in _READERS:
        _READERS[key] = PageReader(cache.layout)
    return _READERS[key]


def certified_rows(call: LayerCall) -> tuple[torch.Tensor, CertReport]:
    """The call's rows (host ``tables``/``lens``) → ``(out [R, H_q, D] float32, report [R, H_q])``, in chunks
    of rows; rungs 3/4 not applied."""
    cache, q = call.cache, call.q
    per_row = max(1, int(call.lens.max()) // cache.layout.block_size) * cache.layout.head_dim * q.shape[1] * 16
    step = max(1, ROW_CHUNK_ELEMENTS // per_row)
    parts = [_chunk(call.rows(slice(start, start + step))) for start in range(0, q.shape[0], step)]
    return torch.cat([out for out, _ in parts]), CertReport.cat([report for _, report in parts])


def _chunk(call: LayerCall) -> tuple[torch.Tensor, CertReport]:
    q, cache, tables, lens, cfg, pagein = call.q, call.cache, call.tables, call.lens, call.cfg, call.pagein
    R, Hq, D = q.shape
    K = cache.num_kv_heads
    G = Hq // K
    N = cache.layout.block_size
    dev = cache.pages.device
    policy = cfg.ladder

    nfull = lens // N
    ntail = lens % N
    B = max(1, int(nfull.max()))
    qs = (q.to(dev).float() * call.scale).view(R, K, G, D)
    q_abs = qs.abs()

    # ---- trailing partial block: its originals from the shadow (zeros for rows without one)
    has_tail = ntail > 0
    tail_ids = tables.gather(1, nfull.clamp(max=tables.shape[1] - 1).unsqueeze(1)).squeeze(1)
    tail = torch.zeros(R, K, 2, N, D, device=dev)
    if bool(has_tail.any()):
        tail[has_tail.to(dev)] = pagein.gather_blocks(cache, tail_ids[has_tail]).float()

    # ---- full blocks: phase 1 on the INT8 keys
    ids = tables[:, :B].clamp(0, cache.num_blocks - 1)
    bvalid = (torch.arange(B) < nfull.unsqueeze(1)).to(dev)  # (R, B)
    valid4 = bvalid[:, None, None, :]
    dec = _reader(cache).decode(cache.read_pages(ids))  # keys (R, B, K, N, D)
    s8 = torch.einsum("rkgd,rbknd->rkgbn", qs, dec.keys).masked_fill(~valid4.unsqueeze(-1), float("-inf"))
    delta = block_delta(q_abs, dec.sigma).masked_fill(~valid4, 0.0)
    rnd = score_rounding(q_abs, dec.key_mag).masked_fill(~valid4, 0.0)
    eta = dec.eta.permute(0, 2, 1).masked_fill(~bvalid[:, None, :], 0.0)  # (R, K, B)
    nu = dec.nu.permute(0, 2, 1).masked_fill(~bvalid[:, None, :], 0.0)
    bad_page = ((dec.violated | ~dec.valid) & bvalid.unsqueeze(-1)).any(dim=(1, 2))  # (R,)
    l8 = torch.logsumexp(s8, dim=-1)
    summary = summarize(qs, tail[:, :, 0], tail[:, :, 1], ntail, nu, eta, finite_abs_max(s8, (-1, -2)),
                        rnd.amax(dim=-1), l8)  # fmt: skip
    s_tail = summary.s_tail

    # ---- selection (rungs 1 and 2)
    if policy.certified:
        ph1 = Phase1(
            log_mass=l8, mass=torch.exp(l8 - summary.lse.unsqueeze(-1)), delta=delta, rounding=summary.round1,
            valid=valid4, num_full=nfull.to(dev).view(R, 1, 1), v_max=summary.v_max, eta=eta.unsqueeze(2),
        )  # fmt: skip
        key_mask, widened = select_keys(ph1, cfg, call.generator)
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
        if policy.checks_canary:
            bad = canary_violations(s_items, s8[r_i, k_i, :, b_i], delta[r_i, k_i, :, b_i],
                                    summary.round1[r_i, k_i])  # fmt: skip
            canary_row[r_i[bad]] = True

    # ---- phase 2: one softmax over every token
    m = torch.maximum(s2.amax(dim=(-1, -2)), s_tail.amax(dim=-1))  # (R, K, G)
    w = torch.exp(s2 - m[..., None, None])
    den_b = w.sum(dim=-1)  # (R, K, G, B)
    num_b = torch.einsum("rkgbn,rbknd->rkgbd", w, dec.values)
    if items_v is not None and bool(value_mask.any()):
        num16 = num_b.clone()
        num16[r_i, k_i, :, b_i] = torch.einsum("ngs,nsd->ngd", w[r_i, k_i, :, b_i], items_v)
        num_b = torch.where(value_mask.unsqueeze(-1), num16, num_b)
    out, den, den_t = combine(num_b.double().sum(dim=-2), den_b.double().sum(dim=-1), s_tail, summary.tail_v, m)

    # ---- bounds, checks and report on the output actually computed
    rho = den_b.double() / den.unsqueeze(-1)
    measured = Measured(
        value_error_mass=(torch.where(valid4 & ~value_mask, rho, 0.0) * eta.unsqueeze(2).double()).sum(dim=-1),
        tail_mass=torch.where(valid4 & ~key_mask, rho, 0.0).sum(dim=-1),
        score_abs2=torch.maximum(finite_abs_max(s2, (-1, -2)), finite_abs_max(s_tail, (-1,))),
        exact_log_mass=m.unsqueeze(-1) + torch.log(den_b), exact_tail_log_mass=m + torch.log(den_t),
        key_mask=key_mask, value_mask=value_mask, widened=widened, delta=delta, l8=l8, valid=valid4,
        has_tail=has_tail, canary=canary_row, bad_page=bad_page,
    )  # fmt: skip
    return out, certify(measured, summary, policy, N)
