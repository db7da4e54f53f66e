"""The promotion pass (``phase2.promote``) alone against a torch reference, at widths of several bitmask tiles.

The pass visits only the needed blocks of each ``PB``-block tile (their positions are the set bits of one int64), so
the cases put needed blocks at both ends of tiles (positions 0, 63, 64, 74 of a split), across split boundaries, on
blocks past a row's full blocks (never visited) and on inactive groups (nothing written). Exact-key scores are
float32 sums over D in another order than the reference's: each within 2·γ_D·Σ|q·k| of the reference (both within
γ_D of the real number); the other scores bit for bit; maxima exactly on the pass's own scores; the canary
exactly. In Triton's interpreter here, compiled on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from certvllm.triton_kernels.phase2 import Phase2Geometry, promote  # noqa: E402
from certvllm.triton_kernels.tuning import KernelTuning  # noqa: E402

from certvllm.formats.layout import PageLayout  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
R, K, G, D, N = 2, 2, 2, 64, 16
B, SPLITS, BPS = 150, 2, 75  # split 0: blocks 0–74 (tiles 0–63, 64–74), split 1: 75–149
NFULL = (150, 140)


def _inputs(canary_bad: bool):
    g = torch.Generator().manual_seed(7)
    E = R * B
    shadow = torch.randn(E, K, 2, N, D, generator=g).to(torch.float16)
    qs = torch.randn(R, K * G, D, generator=g)
    tables = torch.randperm(E, generator=g).view(R, B).to(torch.int64)
    nfull = torch.tensor(NFULL, dtype=torch.int64)
    bits = torch.zeros(R, K, B, dtype=torch.int32)
    key_all, value0 = (1 << G) - 1, 1 << G
    for b in (0, 63, 64, 74, 75, 75 + 63, 75 + 64, 149):  # tile ends and split boundaries
        bits[:, :, b] = key_all
    bits[0, 1, 5] = 1  # keys of query head 0 only
    bits[1, 0, 100] = value0  # values only: keys read for the canary alone
    bits[1, 1, 145] = key_all  # past row 1's 140 full blocks: never visited
    active = torch.ones(R, K, dtype=torch.int32)
    active[1, 1] = 0  # an inactive group writes nothing
    kk = shadow[:, :, 0].float()  # [E, K, N, D]
    exact = torch.einsum("rkgd,rbknd->rkbgn", qs.view(R, K, G, D), kk[tables]).contiguous()  # [R, K, B, G, N]
    delta = torch.rand(R, K, G, B, generator=g) * 0.1
    round1 = torch.full((R, K, G), 1e-3)
    noise = (torch.rand(exact.shape, generator=g) - 0.5) * 0.1  # within Δ_b + 2R of the exact scores
    s8 = exact + noise * delta.permute(0, 1, 3, 2)[..., None]
    if canary_bad:
        s8[0, 0, 63, 1, 4] += 10.0  # one promoted block's INT8 score far from its exact one
    m8 = s8.amax(dim=-1).permute(0, 1, 3, 2).contiguous()  # [R, K, G, B]
    return qs, shadow, tables, nfull, bits, active, s8, m8, delta, round1, exact


@pytest.mark.parametrize("run_canary", [False, True])
@pytest.mark.parametrize("canary_bad", [False, True])
@pytest.mark.parametrize("promote_warps", [0, 1, 4])
def test_promotion_pass_matches_the_torch_reference(run_canary: bool, canary_bad: bool, promote_warps: int) -> None:
    """Also with one and four warps per program (``KernelTuning.promote_warps``; 0 is the default, 2 here):
    other layouts of the same sums, within the same bounds."""
    qs, shadow, tables, nfull, bits, active, s8, m8, delta, round1, exact = _inputs(canary_bad)
    tuning = KernelTuning(promote_warps=promote_warps)
    geo = Phase2Geometry(PageLayout(D), K, G, 1, shadow.shape[0], SPLITS, BPS, tuning=tuning)
    scores = s8.clone().to(DEV)
    canary = torch.zeros(R, dtype=torch.int32, device=DEV)
    smax, sabs = promote(geo, qs.to(DEV), shadow.to(DEV) if DEV.type == "cuda" else shadow, tables.to(DEV),
                         nfull.to(DEV), bits.to(DEV), active.to(DEV), scores, m8.to(DEV), delta.to(DEV),
                         round1.to(DEV), canary, run_canary)  # fmt: skip
    scores, smax, sabs, canary = scores.cpu(), smax.cpu(), sabs.cpu(), canary.cpu()

    full = torch.arange(B)[None, :] < nfull[:, None]  # [R, B]
    heads = torch.arange(G).view(1, 1, G, 1)
    keyp = (((bits[:, :, None, :] >> heads) & 1) != 0) & full[:, None, None, :]  # [R, K, G, B]
    on = active.bool()
    rewritten = (keyp.permute(0, 1, 3, 2) & on[:, :, None, None])[..., None].expand_as(s8)  # [R, K, B, G, N]
    # float32 sums of D products in two orders: each within γ_D·Σ|q·k| of the real number
    gamma = D * 2.0**-24 / (1 - D * 2.0**-24)
    mags = torch.einsum("rkgd,rbknd->rkbgn", qs.view(R, K, G, D).abs(), shadow[:, :, 0].float().abs()[tables])
    assert ((scores - exact).abs() <= 2 * gamma * mags)[rewritten].all()
    assert torch.equal(scores[~rewritten], s8[~rewritten])  # every other score as it came, bit for bit
    got = scores.permute(0, 1, 3, 2, 4)  # [R, K, G, B, N] the pass's own exact scores
    for split in range(SPLITS):
        cols = slice(split * BPS, (split + 1) * BPS)
        kp = keyp[..., cols]
        cand = torch.where(kp[..., None], got[..., cols, :], torch.where(full[:, None, None, cols, None],
                           m8[..., cols, None].expand(-1, -1, -1, -1, N), -torch.inf))  # fmt: skip
        want_max = cand.flatten(-2).amax(-1)
        want_abs = torch.where(kp[..., None], got[..., cols, :].abs(), 0.0).flatten(-2).amax(-1)
        assert torch.equal(smax[on][..., split], want_max[on]), split
        assert torch.equal(sabs[on][..., split], want_abs[on]), split
    # the canary: a visited block (keys or, with the canary, values promoted) whose INT8 scores leave Δ_b + 2R
    visited = ((bits != 0) if run_canary else ((bits & ((1 << G) - 1)) != 0)) & full[:, None, :] & on[..., None]
    allowed = (delta + 2 * round1[..., None]) * (1 + 2**-10)  # [R, K, G, B]
    viol = ((exact - s8).abs() > allowed.permute(0, 1, 3, 2)[..., None]).any(-1).any(-1)  # [R, K, B]
    want_canary = (viol & visited).any(-1).any(-1).to(torch.int32) if run_canary else torch.zeros(R, dtype=torch.int32)
    assert torch.equal(canary, want_canary)
    assert bool(want_canary[0]) == (run_canary and canary_bad)  # the planted violation, and no other


def test_the_promotion_benchmark_counts_the_work_and_replays_its_variants() -> None:
    """``benchmarks/bench_promote.py`` (a GPU benchmark) on the inputs above: its workload counts are the torch
    counts of needed blocks, and each variant replays ``promote`` with the argument it names changed (the bitmask
    cleared: no score rewritten; no canary: the canary untouched; keys only: value-only blocks not visited)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_promote

    qs, shadow, tables, nfull, bits, active, s8, m8, delta, round1, _ = _inputs(canary_bad=True)
    geo = Phase2Geometry(PageLayout(D), K, G, 1, shadow.shape[0], SPLITS, BPS)
    canary = torch.zeros(R, dtype=torch.int32)
    args = (geo, qs, shadow, tables, nfull, bits, active, s8.clone(), m8, delta, round1, canary, True, None, None,
            None)  # fmt: skip
    full = torch.arange(B)[None, :] < nfull[:, None]
    need = (bits != 0) & full[:, None, :] & (active[..., None] != 0)
    work = bench_promote.workload(args)
    assert work["needed_total"] == int(need.sum()) and "needed_over_pcie" not in work
    assert work["needed_max_per_program"] == int(need.view(R, K, SPLITS, BPS).sum(-1).max())
    got = {}
    for name, v in bench_promote.variants(args).items():
        scores, flag = v[7].clone(), torch.zeros(R, dtype=torch.int32)
        promote(*v[:7], scores, *v[8:11], flag, *v[12:])
        got[name] = (scores, flag)
    assert torch.equal(got["nothing_needed"][0], s8) and int(got["nothing_needed"][1].sum()) == 0
    assert int(got["no_canary"][1].sum()) == 0 and int(got["as_called"][1][0]) == 1  # the planted violation
    assert torch.equal(got["keys_only"][0], got["as_called"][0])  # value bits never rewrite scores
    assert torch.equal(got["shadow_keys"][0], got["as_called"][0])  # no pool here: the same reads
