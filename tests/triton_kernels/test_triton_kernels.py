"""The Triton kernels against the PyTorch reference, at tiny shapes.

Without a GPU they run in Triton's interpreter (``TRITON_INTERPRET=1``, set here before any kernel is
defined); on a CUDA machine the same tests run the compiled kernels on the device. The interpreter (the CPU lane,
``make test``) runs at least one case of every kernel; the cases it would only repeat at interpreter speed (other
families, presets and shapes of the same kernels, and the tiling variants the CPU path never runs: split plans,
attend tiles) and the CUDA-only features (promotion pool, step prefetch) run in the GPU lane only
(``pytest -m gpu``), compiled. Full shapes, the
soundness sweep on the GPU and the timing live in ``tests/triton_kernels/test_gpu.py`` (``pytest -m gpu``).

Tolerances: the write kernel must reproduce ``encode_pages`` bit for bit on finite inputs except η/ν (both
round up norms summed in another order: 2^-12 relative, and each must bound the errors); the certified
GPU path must satisfy ‖out − exact‖₂ ≤ e_key + e_val on every head with rung ≤ 2 (float64 exact
reference, no slack), return ``dense_decode`` bit for bit on rung 3/4 heads with the SDPA fallback, and
agree with the CPU reference path on selection, rungs and (to float32 rounding) the output.

"To float32 rounding" is FlashAttention's rule (``certvllm.testing.assert_within_lowp_error``): the worst
deviation of an output from the float64 evaluation of the computation it made (``run_with_exact``: the
call's own selection, exact dequantization, exact attention on rung 3/4 heads) is at most ``factor = 2``
times that of a plain float32 implementation of the same computation — the torch reference path
(``backend="reference"``, whose selection must evaluate to the same float64 answer), ``dense_decode``
(SDPA) for rung 3/4 heads recomputed on the device, the torch glue for the glue kernels — plus
``atol = 2^-23·max|v|`` (a float32 ulp at the values' scale: the floor where the low-precision reference
happens to be exact). It replaces rtol = 1e-5, atol = 1e-5·max|v| for the device recompute (40x stricter at
these inputs); the other fixed tolerances stay, as the rule alone is looser on some element (near-zero
outputs): rtol = 1e-4, atol = 1e-5 against the CPU path, rtol = 1e-6, atol = 1e-7 between two split plans,
rtol = 1e-5, atol = 1e-6·max|v| between the glue kernels and the torch glue. Bound terms are
compared to rtol = 1e-3 (1e-5/1e-6 between the glue kernels and the torch glue): directed-rounding sums in
another order, with no float64 counterpart.
"""

from __future__ import annotations

import math
import os
from functools import partial

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from certvllm.triton_kernels.common import key_scale_sigma  # noqa: E402
from certvllm.triton_kernels.encode import encode_pages_triton  # noqa: E402
from certvllm.triton_kernels.tuning import KernelTuning  # noqa: E402

from certvllm.attention import certified_attention, dense_decode  # noqa: E402
from certvllm.attention.gpu import CudaOptions  # noqa: E402
from certvllm.attention.op import dense_rows  # noqa: E402
from certvllm.attention.selection import Phase1  # noqa: E402
from certvllm.config import load_config, make_config  # noqa: E402
from certvllm.formats.keys import P2_RELATIVE_SLACK  # noqa: E402
from certvllm.formats.layout import BLOCK_SIZE, FLAG_PRECONDITION, PageLayout, key_scale_lut  # noqa: E402
from certvllm.formats.pages import PageReader, encode_pages  # noqa: E402
from certvllm.kv.cache import LayerKVCache  # noqa: E402
from certvllm.kv.cuda_pagein import CudaPageInEngine, encode_blocks_from_shadow, ensure_device_readable  # noqa: E402
from certvllm.kv.residency import Residency  # noqa: E402
from certvllm.testing import (  # noqa: E402
    assert_within_lowp_error,
    exact_attention,
    make_case,
    out_of_phase1_range_case,
    paged_batch,
    run_with_exact,
)

pytestmark = pytest.mark.slow  # minutes in the interpreter: make test runs it, make test-quick does not
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA-only feature: runs compiled in pytest -m gpu"),
]
"""The promotion pool, the step prefetch and the attend pass's tilings exist only on the CUDA path: their tests
run compiled on the GPU (``pytest -m gpu``), not in the interpreter."""


def _cuda_only(fn):
    for mark in CUDA_ONLY:
        fn = mark(fn)
    return fn


def _gpu_lane(*values):
    """A parameter set that runs compiled in the GPU lane only (``pytest -m gpu``): every kernel keeps at least
    one interpreter case on the CPU lane, and the interpreter (seconds to minutes per call) runs no more than
    that; the other shapes, families and presets of the same assertions run on the device."""
    return pytest.param(*values, marks=CUDA_ONLY)


def assert_same_pages(got: torch.Tensor, ref: torch.Tensor, lay: PageLayout) -> None:
    """Every byte identical except η/ν, which both implementations round up from norms evaluated in a
    different order (float64 here, scaled float32 in ``encode_pages``): they must agree to 2^-12 relative,
    far inside the NORM_SLACK band that makes each of them an upper bound."""
    h = lay.header
    assert torch.equal(got[..., :h], ref[..., :h]) and torch.equal(got[..., h + 8 :], ref[..., h + 8 :])
    a = got[..., h : h + 8].contiguous().view(torch.float32).double()
    b = ref[..., h : h + 8].contiguous().view(torch.float32).double()
    assert ((a - b).abs() <= 2.0**-12 * b).all()


def _to_device(cache: LayerKVCache) -> LayerKVCache:
    """The same cache with its pages on ``DEV`` (the shadow stays on the host)."""
    return LayerKVCache(cache.pages.to(DEV), cache.shadow, cache.layout, cache.keys_channel_major)


def _call(cache, q, tables, lens, cfg, residency=None, **kw):
    """The op on its CUDA path (compiled on a GPU, interpreted here), rungs 3/4 on the device, as the vLLM
    backend calls it."""
    return certified_attention(q, cache, tables, lens, cfg, backend="cuda", residency=residency, **kw)


FACTOR = 2.0
ULP = 2.0**-23  # atol of the float32 rule per unit of max|v|


def _vmax(cases) -> float:
    return max(float(c.v.float().abs().max()) for c in cases)


def _check(cases, cfg, fallback="sdpa", blocks_per_split=None):
    """One certified CUDA call over ``cases``, checked for soundness; ``fallback="sdpa"`` recomputes rungs 3/4
    on the host's row list (``exact_rows``), ``"device"`` on the device. Returns the result, the host inputs
    and the float64 evaluation of what the call computed (``run_with_exact``)."""
    cache, tables, lens = paged_batch(cases, cfg.value_group_size)
    q = torch.stack([c.q for c in cases])
    scale = 1 / math.sqrt(q.shape[-1])
    dcache, dq, dtables, dlens = _to_device(cache), q.to(DEV), tables.to(DEV), lens.to(DEV)
    eng = CudaPageInEngine(DEV)
    rows = dense_rows(dq, dcache, dtables, dlens, scale, eng, cfg.dense_backend) if fallback == "sdpa" else None
    call = partial(_call, dcache, dq, dtables, dlens, cfg, pagein=eng, exact_rows=rows,
                   cuda_options=CudaOptions(blocks_per_split=blocks_per_split))  # fmt: skip
    res, exact64 = run_with_exact(call, q, cache, tables, lens, scale)
    out, rung, bound = res.out.cpu(), res.report.rung.cpu(), res.report.bound.cpu().double()
    for i, c in enumerate(cases):
        err = torch.linalg.vector_norm(out[i].double() - exact_attention(c.q, c.k, c.v, scale), dim=-1)
        certified = rung[i] <= 2
        assert (err[certified] <= bound[i][certified]).all(), f"error > bound: {(err - bound[i]).max()}"
        exact = rung[i] >= 3
        if exact.any():
            dense = dense_decode(c.q.to(DEV), c.k.to(DEV), c.v.to(DEV), scale).cpu()
            if fallback == "sdpa":
                assert torch.equal(dense[exact], out[i][exact])
            else:
                ref64 = exact_attention(c.q, c.k, c.v, scale)
                assert_within_lowp_error(out[i][exact], ref64[exact], dense[exact], factor=FACTOR,
                                         atol=ULP * _vmax([c]), what=f"row {i}, rungs 3/4 on the device")  # fmt: skip
    return res, (cache, tables, lens, q), exact64


@pytest.mark.parametrize(
    "d,g,dtype,levels",
    [(64, 16, torch.float16, (255, 15)), (128, 16, torch.bfloat16, (255, 15)), (64, 8, torch.bfloat16, (255, 15)),
     (128, 32, torch.float16, (255, 15)), (64, 16, torch.float16, (15, 3))],  # the last: a stress-study format
)  # fmt: skip
def test_encode_kernel_matches_the_reference(d, g, dtype, levels, gen):
    lay = PageLayout(d, g, key_levels=levels[0], value_levels=levels[1])
    k = (torch.randn(10, BLOCK_SIZE, d, generator=gen) * torch.rand(10, 1, d, generator=gen) * 5).to(dtype)
    v = (torch.randn(10, BLOCK_SIZE, d, generator=gen) * 3).to(dtype)
    k[1, :, 3] = 0.7  # constant channel: σ = 0
    v[2] = 1.0  # constant groups: scale 0
    k[3] *= 1e-3
    v[4] *= 1e-20 if dtype == torch.bfloat16 else 1e-3
    k[5, :, :8] *= 100.0  # outlier channels
    v[6, 3] = -60000.0
    got = encode_pages_triton(k.to(DEV), v.to(DEV), lay).cpu()
    assert_same_pages(got, encode_pages(k, v, lay), lay)
    dec = PageReader(lay).decode(got)
    assert (torch.linalg.vector_norm(dec.values.double() - v.double(), dim=-1).amax(-1) <= dec.eta.double()).all()


def test_encode_kernel_flags_and_guarantees_on_hostile_inputs(gen):
    lay = PageLayout(64)
    k = torch.randn(5, BLOCK_SIZE, 64, generator=gen).bfloat16()
    v = torch.randn(5, BLOCK_SIZE, 64, generator=gen).bfloat16()
    k[0, 2, 5] = float("nan")
    v[1, 0, 0] = float("inf")
    k[2, 4, 1] = -3e5  # below the float16 range: the offset cannot be stored
    v[3, 7, 9] = 1e6
    pages = encode_pages_triton(k.to(DEV), v.to(DEV), lay).cpu()
    flags = pages[:, lay.header + 9]
    assert ((flags[:4] & FLAG_PRECONDITION) != 0).all() and (flags[4] & FLAG_PRECONDITION) == 0
    dec = PageReader(lay).decode(pages[4:])
    kk, vv = k[4:].double(), v[4:].double()
    assert ((dec.keys.double() - kk).abs() <= dec.sigma.double().unsqueeze(-2) * (0.5 + P2_RELATIVE_SLACK)).all()
    assert (torch.linalg.vector_norm(dec.values.double() - vv, dim=-1).amax(-1) <= dec.eta.double()).all()
    assert (torch.linalg.vector_norm(vv, dim=-1).amax(-1) <= dec.nu.double()).all()


@pytest.mark.parametrize("sub,channel_major", [(1, False), (4, False), (4, True)])
def test_gather_and_in_place_encode_from_the_shadow(sub, channel_major, gen):
    lay = PageLayout(64)
    pages = torch.zeros(5, 3, sub * lay.page_bytes, dtype=torch.uint8, device=DEV)
    shadow = torch.randn(5, 3, 2, sub * BLOCK_SIZE, 64, generator=gen).bfloat16()
    cache = LayerKVCache(pages, shadow, lay, keys_channel_major=channel_major)
    eng = CudaPageInEngine(DEV)
    ids = torch.tensor([0, 3, 5 * sub - 2, 5 * sub - 1])
    heads = torch.tensor([2, 0, 1, 1])
    assert torch.equal(eng.gather_kv(cache, ids, heads).cpu(), cache.shadow_pages(ids, heads))
    assert torch.equal(eng.gather_blocks(cache, ids).cpu(), cache.shadow_blocks(ids))
    assert eng.take_stats().bytes == 4 * 2 * BLOCK_SIZE * 64 * 2 * 4
    encode_blocks_from_shadow(cache, ids.to(DEV))
    src = cache.shadow_blocks(ids)
    assert_same_pages(cache.read_pages(ids.to(DEV)).cpu(), encode_pages(src[:, :, 0], src[:, :, 1], lay), lay)


@pytest.mark.parametrize("sub,channel_major", [(1, False), (4, True)])
def test_gather_reads_current_keys_from_a_write_through_pool(sub, channel_major, gen):
    """``gather_blocks(..., direct)`` (the exact prefill's cached context): a page's keys come from the pool where
    its slot holds (page, the block's current generation), from the shadow where the slot is empty, holds another
    page or an older generation; values always from the shadow. The pool's bytes are made to differ from the
    shadow's here (they are the same bytes in serving) so that the source of every page is visible."""
    lay, H, d = PageLayout(64), 3, 64
    E = 5
    shadow = torch.randn(E, H, 2, sub * BLOCK_SIZE, d, generator=gen).bfloat16()
    cache = LayerKVCache(torch.zeros(E, H, sub * lay.page_bytes, dtype=torch.uint8, device=DEV), shadow, lay,
                         keys_channel_major=channel_major)  # fmt: skip
    generation = torch.randint(0, 3, (E * sub,), generator=gen).to(DEV)
    P = E * sub * H  # one slot per page: slot e holds page e
    keys = torch.randn(P, BLOCK_SIZE, d, generator=gen).bfloat16().to(DEV)
    pages = torch.arange(P)
    state = torch.randint(0, 3, (P,), generator=gen)  # 0 held, 1 empty, 2 an older generation
    tag = torch.where(state == 1, -1, pages).to(DEV)
    tag_gen = generation.repeat_interleave(H) - (state == 2).to(torch.int64).to(DEV)
    ids = torch.tensor([0, 3, E * sub - 2, E * sub - 1, 1])
    eng = CudaPageInEngine(DEV)
    got = eng.gather_blocks(cache, ids, (keys, tag, tag_gen, generation)).cpu()  # [n, H, 2, N, D]
    want = cache.shadow_blocks(ids).clone()
    page = ids[:, None] * H + torch.arange(H)[None, :]  # [n, H]
    held = state[page] == 0
    want[:, :, 0][held] = keys.cpu()[page[held]]
    assert torch.equal(got, want)
    assert bool(held.any()) and bool((~held).any())
    assert torch.equal(eng.gather_blocks(cache, ids).cpu(), cache.shadow_blocks(ids))  # no pool: the shadow


@pytest.mark.parametrize("sub", [1, _gpu_lane(2)])
def test_device_write_path_equals_the_host_write_path(sub, gen):
    """``write_tokens_on_device`` (device stores into the shadow, generations, the completed blocks encoded)
    leaves the same shadow bytes, pages and write generations as the host path it replaces
    (``LayerKVCache.write_shadow``, then ``encode_blocks_from_shadow`` of the blocks it returns), over three
    steps: a prefill that fills two blocks and starts a third, padding slots (−1) between real ones, decode
    tokens in scattered blocks, one completing its block, keys and values as strided views of one tensor."""
    from certvllm.kv.cuda_pagein import write_tokens_on_device

    lay, heads, d = PageLayout(64), 3, 64
    caches = []
    for _ in range(2):
        pages = torch.zeros(8, heads, sub * lay.page_bytes, dtype=torch.uint8, device=DEV)
        shadow = torch.zeros(8, heads, 2, sub * BLOCK_SIZE, d, dtype=torch.bfloat16)
        cache = LayerKVCache(pages, shadow, lay)
        cache.enable_generations()
        caches.append(cache)
    host, device = caches
    steps = [list(range(16, 16 + 40)), [-1, 3 * 16 + 5, -1, 70], [71, 100, 16 + 40, 3 * 16 + 6, -1]]
    steps[2] = [16 + 47 if s == 16 + 40 else s for s in steps[2]]  # a slot at offset 15: completes block 3
    for slots in steps:
        kv = torch.randn(len(slots), heads, 3 * d, generator=gen).bfloat16().to(DEV)  # [T, H, k|v|other]
        key, value = kv[..., :d], kv[..., d : 2 * d]  # strided views, as vLLM's qkv split hands them over
        slot_t = torch.tensor(slots, dtype=torch.int64)
        full = host.write_shadow(key, value, slot_t.to(DEV))
        if full.numel():
            encode_blocks_from_shadow(host, full.to(DEV))
        write_tokens_on_device(device, key, value, slot_t.to(DEV))
    assert torch.equal(device.shadow, host.shadow)
    assert torch.equal(device.pages, host.pages)
    assert torch.equal(device.generation, host.generation)
    assert int(host.generation.sum()) > 0


def test_completed_blocks_read_the_write_for_its_tokens_and_the_shadow_for_the_rest(gen):
    """``encode_completed_blocks(..., source=(key, value))``: token j of a completed block is read from the write
    where the write's token 15 − j places before the block's last one has the block's j-th slot (all 16 of a
    prefill's block, the last token of a block a decode token completes, a chunk's tokens of the block an
    earlier chunk began), every other token from the shadow. The write's tokens are made to differ from the
    shadow here (in serving the shadow holds the same bytes) so that each token's
    source shows in its page; in a reordered block (two slots swapped) those two come from the shadow."""
    from certvllm.triton_kernels.encode import encode_completed_blocks

    from certvllm.formats.pages import encode_pages

    lay, heads, d = PageLayout(64), 3, 64
    pages = torch.zeros(8, heads, lay.page_bytes, dtype=torch.uint8, device=DEV)
    shadow = torch.randn(8, heads, 2, BLOCK_SIZE, d, generator=gen).bfloat16()
    cache = LayerKVCache(pages, shadow, lay)
    cache.enable_generations()
    shadow = ensure_device_readable(cache)
    # blocks 1 and 2 whole in the write, block 3 begun, a decode token completing block 4, block 5 out of order,
    # block 6's last 5 tokens (an earlier chunk wrote its first 11)
    order5 = [5 * 16 + j for j in range(16)]
    order5[3], order5[4] = order5[4], order5[3]
    slots = list(range(16, 16 + 40)) + [4 * 16 + 15] + order5 + [6 * 16 + j for j in range(11, 16)]
    kv = torch.randn(len(slots), heads, 3 * d, generator=gen).bfloat16().to(DEV)
    key, value = kv[..., :d], kv[..., d : 2 * d]  # strided views, as vLLM hands them over
    slot_t = torch.tensor(slots, dtype=torch.int64, device=DEV)
    encode_completed_blocks(cache.pages, shadow, slot_t, lay, heads, 1, cache.generation, source=(key, value))
    from_write = {1: range(16), 2: range(16), 4: [15], 5: [j for j in range(16) if j not in (3, 4)],
                  6: range(11, 16)}  # fmt: skip
    for block, tokens in from_write.items():
        src = cache.shadow_blocks(torch.tensor([block]))[0]  # [H, 2, 16, D]
        k, v = src[:, 0].clone(), src[:, 1].clone()
        for j in tokens:
            at = slots.index(block * 16 + j)
            k[:, j], v[:, j] = key[at].cpu(), value[at].cpu()
        assert_same_pages(cache.read_pages(torch.tensor([block], device=DEV)).cpu(),
                          encode_pages(k.unsqueeze(0), v.unsqueeze(0), lay), lay)  # fmt: skip
    assert not bool(cache.read_pages(torch.tensor([3], device=DEV)).any())  # block 3 is not full: not encoded
    assert cache.generation.tolist() == [0, 1, 1, 0, 1, 1, 1, 0]


@pytest.mark.parametrize("sub", [1, _gpu_lane(2)])
def test_write_through_pool_holds_the_written_keys_under_their_generation(sub, gen):
    """A write-through pool (one slot per page) filled by ``write_tokens_on_device``: after each write, exactly the
    completed blocks' slots are tagged, each with its own page id and its block's current write generation, and
    hold that page's keys bit for bit as in the shadow; the write leaves the same shadow, pages and generations as
    without the pool; a lookup then finds every completed page without a fill; a block re-encoded later (its
    generation bumped) is not served from its old copy. A pool with fewer slots than pages is not write-through
    and the write leaves it untouched."""
    from certvllm.kv.cuda_pagein import write_tokens_on_device
    from certvllm.kv.promotion_cache import PromotionCache

    lay, heads, d = PageLayout(64), 3, 64
    caches = []
    for _ in range(2):
        pages = torch.zeros(8, heads, sub * lay.page_bytes, dtype=torch.uint8, device=DEV)
        shadow = torch.zeros(8, heads, 2, sub * BLOCK_SIZE, d, dtype=torch.bfloat16)
        caches.append(LayerKVCache(pages, shadow, lay))
    plain, cache = caches
    plain.enable_generations()
    pool = PromotionCache(cache, cache.num_blocks * heads)
    hashed = PromotionCache(plain, cache.num_blocks * heads - 1)
    assert pool.write_through and not hashed.write_through
    steps = [list(range(16, 16 + 40)), [-1, 3 * 16 + 5, -1, 70], [71, 100, 16 + 47, 3 * 16 + 6, -1]]
    completed: set[int] = set()
    for slots in steps:
        kv = torch.randn(len(slots), heads, 2 * d, generator=gen).bfloat16().to(DEV)
        key, value = kv[..., :d], kv[..., d:]
        slot_t = torch.tensor(slots, dtype=torch.int64).to(DEV)
        write_tokens_on_device(plain, key, value, slot_t, hashed)
        write_tokens_on_device(cache, key, value, slot_t, pool)
        completed |= {s // BLOCK_SIZE for s in slots if s >= 0 and s % BLOCK_SIZE == BLOCK_SIZE - 1}
        tagged = {int(e) // heads for e in (pool.tag >= 0).nonzero().flatten().cpu()}
        assert tagged == completed
        for name in ("shadow", "pages", "generation"):
            assert torch.equal(getattr(cache, name), getattr(plain, name)), name
    assert completed == {1, 2, 3}
    assert bool((hashed.tag == -1).all()) and not bool(hashed.pool.any()), "a hashed pool is filled by lookups only"
    filled = (pool.tag >= 0).cpu()
    page_ids = filled.nonzero().flatten()
    assert torch.equal(pool.tag.cpu()[filled], page_ids)
    assert torch.equal(pool.tag_gen.cpu()[filled], cache.generation.cpu()[page_ids // heads])
    assert torch.equal(pool.pool.cpu()[filled], cache.shadow_pages(page_ids // heads, page_ids % heads)[:, 0])
    # a lookup of every completed page: all hits, nothing to fill
    tables = torch.tensor([[1, 2, 3, 0]]).to(DEV)
    need = torch.ones(1, heads, 4, dtype=torch.bool, device=DEV)
    need[..., 3] = False
    slot_map, claim, hit = pool.resolve(tables, need, cache.num_blocks)
    assert torch.equal(hit, need) and not bool(((claim >= 0) & (claim < 2**62)).any())
    encode_blocks_from_shadow(cache, torch.tensor([2]).to(DEV))  # block 2 rewritten: its old copies are stale
    slot_map, claim, hit = pool.resolve(tables, need, cache.num_blocks)
    assert not bool(hit[..., 1].any()) and bool(hit[..., 0].all()) and bool(hit[..., 2].all())


@pytest.mark.parametrize(
    "family,preset",
    [("random", "default"), ("sink_and_recency", "strict"), _gpu_lane("retrieval_peaks", "fast"),
     _gpu_lane("outlier_channels", "naive")],
)  # fmt: skip
def test_gpu_path_matches_the_reference_and_is_sound(family, preset, gen):
    cases = [make_case(family, t, 8, 2, 64, torch.float16, gen) for t in (5, 37, 130, 200)]
    cfg = load_config(preset)
    res, (cache, tables, lens, q), exact64 = _check(cases, cfg, blocks_per_split=3)
    ref = certified_attention(q, cache, tables, lens, cfg)
    assert torch.equal(res.report.k_star.cpu(), ref.report.k_star)
    assert torch.equal(res.report.v_promoted.cpu(), ref.report.v_promoted)
    assert torch.equal(res.report.rung.cpu(), ref.report.rung)
    reference = partial(certified_attention, q, cache, tables, lens, cfg, backend="reference")
    plain, plain64 = run_with_exact(reference, q, cache, tables, lens, 1 / 8)
    assert torch.equal(plain64, exact64)  # the same selection: the same computation
    assert_within_lowp_error(res.out.cpu(), exact64, plain.out, factor=FACTOR, atol=ULP * _vmax(cases),
                             what=f"CUDA path, {family}/{preset}")  # fmt: skip
    torch.testing.assert_close(res.out.cpu(), ref.out, rtol=1e-4, atol=1e-5)
    # the CUDA path's phase 1 scores on the tensor cores, whose rounding term R_b is larger than the float32 path's
    # (it also bounds the float32 scores: docs/certification.md §5.3), so its bounds are never tighter than the
    # reference's (1e-3: sums in other orders) and larger by R_b's share only (measured ≤ 1.7 % on these families)
    assert bool((res.report.bound.cpu() >= ref.report.bound * (1 - 1e-3) - 1e-12).all())
    assert bool((res.report.bound.cpu() <= ref.report.bound * 1.03 + 1e-12).all())


@pytest.mark.parametrize("fallback", ["sdpa", "device"])
def test_gpu_rungs_3_and_4_are_exact(fallback, gen):
    # rung 3 for every head (bound tolerance) on one row, rung 4 (keys beyond float16) on the other
    cases = [make_case("random", t, 4, 2, 64, torch.bfloat16, gen) for t in (70, 90)]
    cases[1].k[20, 1, 0] = -3e5
    res, _, _ = _check(cases, make_config(bound_tol=1e-9), fallback=fallback)
    assert (res.report.rung[0] == 3).all() and (res.report.rung[1] == 4).all()
    assert res.report.precondition[1].all() and (res.report.bound == 0).all()


def test_a_head_out_of_phase_1s_range_escalates(gen):
    """Phase 1's INT8-MMA scores have a range (docs/certification.md §5.2): a head whose grid exponent falls below it (a
    bfloat16 query 2^-100 times smaller on keys 2^-20 times smaller) gets R_b = +inf, so its bound is infinite and it
    goes to rung 3 with the dense output, alone (the row is not sent to rung 4: its scores stay finite)."""
    res, _, _ = _check(out_of_phase1_range_case(gen), load_config("default"))
    assert int(res.report.rung[0, 1]) == 3 and bool((res.report.rung[0, [0, 2, 3]] <= 2).all())


@pytest.mark.parametrize(
    "family,preset",
    [("retrieval_peaks", "default"), _gpu_lane("random", "coverage"), _gpu_lane("near_tied_blocks", "paper"),
     _gpu_lane("outlier_channels", "naive"), _gpu_lane("sink_and_recency", "strict")],
)  # fmt: skip
def test_resident_pass_is_sound_and_exact_on_rungs_3_and_4(family, preset, gen):
    """``decode_pass: resident`` (no pool here: F is what the top-up promotes) over split-K programs with their own
    maxima: every certified head within its bound, rungs 3/4 equal to dense (host) or exact (device)."""
    cases = [make_case(family, t, 8, 2, 64, torch.float16, gen) for t in (5, 37, 130, 200)]
    cfg = load_config(preset, decode_pass="resident")
    for fallback in ("sdpa", "device"):
        res, _, _ = _check(cases, cfg, fallback=fallback, blocks_per_split=3)
    if cfg.mode == "certified":
        assert (res.report.k_star > 0).any()  # the top-up promoted keys


@_cuda_only  # a tiling variant: the interpreter runs the split plan of the test above
def test_resident_split_plans_agree(gen):
    cases = [make_case("sink_and_recency", t, 6, 2, 64, torch.bfloat16, gen) for t in (100, 250)]
    cfg = load_config("default", decode_pass="resident")
    one, (cache, tables, lens, q), one64 = _check(cases, cfg, blocks_per_split=1)
    many, _, many64 = _check(cases, cfg, blocks_per_split=64)
    assert torch.equal(one.report.rung, many.report.rung) and torch.equal(one64, many64)
    torch.testing.assert_close(one.out, many.out, rtol=1e-6, atol=1e-7)


def test_gpu_canary_catches_pages_that_disagree_with_their_shadow(gen):
    cases = [make_case("random", 10 * BLOCK_SIZE, 4, 2, 64, torch.float16, gen) for _ in range(2)]
    cache, tables, lens = paged_batch(cases)
    lay = cache.layout
    pages = cache.read_pages(tables[0, :10])
    pages[..., lay.k_codes : lay.k_codes + BLOCK_SIZE * lay.head_dim] = 255
    cache.write_pages(tables[0, :10], pages)
    q = torch.stack([c.q for c in cases]).to(DEV)
    dcache, dtables, dlens, cfg = _to_device(cache), tables.to(DEV), lens.to(DEV), load_config("default")
    dense = dense_decode(cases[0].q, cases[0].k, cases[0].v, 1 / 8)
    eng = CudaPageInEngine(DEV)
    host_rows = dense_rows(q, dcache, dtables, dlens, 1 / 8, eng, cfg.dense_backend)
    for exact_rows in (host_rows, None):  # rung 4 recomputed on the host's row list, then on the device
        res = _call(dcache, q, dtables, dlens, cfg, pagein=eng, exact_rows=exact_rows)
        assert (res.report.rung[0] == 4).all() and res.report.canary_fail[0].all()
        assert (res.report.rung[1] <= 2).all()
        if exact_rows is not None:
            assert torch.equal(res.out[0].cpu(), dense)
        else:
            ref64 = exact_attention(cases[0].q, cases[0].k, cases[0].v, 1 / 8)
            assert_within_lowp_error(res.out[0].cpu(), ref64, dense, factor=FACTOR, atol=ULP * _vmax(cases[:1]),
                                     what="rung 4 on the device")  # fmt: skip


@_cuda_only  # a tiling variant: the interpreter runs the split plan of the other tests (3 blocks per split)
def test_split_plans_agree(gen):
    cases = [make_case("sink_and_recency", t, 6, 2, 64, torch.bfloat16, gen) for t in (100, 250)]
    cfg = load_config("default")
    one, (cache, tables, lens, q), one64 = _check(cases, cfg, blocks_per_split=1)
    many, _, many64 = _check(cases, cfg, blocks_per_split=16)
    assert torch.equal(one.report.rung, many.report.rung) and torch.equal(one64, many64)
    plain, plain64 = run_with_exact(partial(certified_attention, q, cache, tables, lens, cfg, backend="reference"),
                                    q, cache, tables, lens, 1 / 8)  # fmt: skip
    assert torch.equal(plain64, one64)
    for name, res in (("1 block", one), ("16 blocks", many)):
        assert_within_lowp_error(res.out.cpu(), one64, plain.out, factor=FACTOR, atol=ULP * _vmax(cases),
                                 what=f"split plan of {name}")  # fmt: skip
    torch.testing.assert_close(one.out, many.out, rtol=1e-6, atol=1e-7)


def test_phase2_split_plan_of_its_own(gen, monkeypatch):
    """Phase 2 on a split plan other than phase 1's (``KernelTuning.phase2_programs_per_sm``): phase 1 splits the
    rows 3 blocks per program, the promotion and attend passes 5 (one plan the other does not divide); the call
    is sound (``_check``), its rungs equal the 3/3 plan's and its output agrees within float32 summation
    order, since phase 2 reads phase 1's outputs per block."""
    from certvllm.triton_kernels.common import split_plan

    from certvllm.attention import gpu

    assert split_plan(10_000, 4, tuning=KernelTuning(programs_per_sm=8, phase2_programs_per_sm=5), phase2=True) == (
        split_plan(10_000, 4, tuning=KernelTuning(programs_per_sm=5))
    )
    cases = [make_case("sink_and_recency", t, 6, 2, 64, torch.bfloat16, gen) for t in (100, 250)]
    cfg = load_config("default")
    same, _, same64 = _check(cases, cfg, blocks_per_split=3)
    planned = []

    def two_plans(num_blocks, groups, blocks_per_split=None, tuning=None, phase2=False):
        plan = split_plan(num_blocks, groups, 5 if phase2 else blocks_per_split)
        planned.append((phase2, plan))
        return plan

    monkeypatch.setattr(gpu, "split_plan", two_plans)
    own, _, own64 = _check(cases, cfg, blocks_per_split=3)
    assert {p for p, _ in planned} == {False, True} and len({plan for _, plan in planned}) == 2
    assert torch.equal(same.report.rung, own.report.rung)
    torch.testing.assert_close(same.out, own.out, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(same64, own64, rtol=1e-6, atol=1e-9)


@_cuda_only
@pytest.mark.parametrize("blk", [1, 2])
def test_attend_pass_replayed_with_other_tiles_agrees(blk, gen):
    """The attend pass of a real call, replayed alone (``capture_attend_args``) with another number of
    blocks per iteration and extra value promotions, agrees with the call's own tiling within float32
    rounding (``attend_deviation``, the check benchmarks/bench_attend.py and the GPU test apply to the
    Gluon configurations)."""
    import dataclasses

    from certvllm.triton_kernels import phase2

    from certvllm.testing import attend_deviation, capture_attend_args

    cases = [make_case(f, t, 6, 2, 64, torch.float16, gen) for f, t in (("retrieval_peaks", 230), ("random", 90))]
    cache, tables, lens = paged_batch(cases)
    q = torch.stack([c.q for c in cases]).to(DEV)
    dcache, dtables, dlens = _to_device(cache), tables.to(DEV), lens.to(DEV)
    args = list(capture_attend_args(lambda: _call(dcache, q, dtables, dlens, load_config("default"))))
    geo, bits = args[0], args[7]
    extra = torch.rand(bits.shape, generator=gen) < 0.3
    g = torch.randint(0, geo.group, bits.shape, generator=gen)
    args[7] = bits | torch.where(extra, 1 << (geo.group + g), 0).int().to(bits.device)

    def run(**kw):
        lm = args[-1].clone()
        tuned = dataclasses.replace(geo, tuning=dataclasses.replace(geo.tuning, **kw))
        return phase2.attend(tuned, *args[1:-1], lm), lm

    ref, ref_lm = run()
    out, lm = run(attend_blk=blk, attend_warps=blk)
    vabs_max = 1.5 * max(float(c.v.float().abs().max()) for c in cases)
    dev = attend_deviation(out, lm, ref, ref_lm, vabs_max)
    assert dev["ok"], dev
    assert bool(torch.isfinite(ref_lm).any())  # key-promoted blocks were written and compared


def test_paper_preset_exploration_draws_on_the_device(gen):
    cases = [make_case("retrieval_peaks", t, 8, 2, 64, torch.float16, gen) for t in (300, 17)]
    res, _, _ = _check(cases, load_config("paper", exploration_rate=0.3))
    assert (res.report.k_star[0] > 2).all()


def _phase1_summary(R, K, G, B, nfull, kind, gen) -> tuple[Phase1, torch.Tensor]:
    """A phase-1 summary (and its lse) of one of several shapes: spread log-masses, ties (equal masses), one
    dominant block, a flat distribution (rung 1 widens), huge Δ (the estimate never meets the tolerance)."""
    l8 = torch.randn(R, K, G, B, generator=gen) * 3
    if kind == "ties":
        l8 = torch.randint(0, 3, (R, K, G, B), generator=gen).float()
    elif kind == "peak":
        l8[..., 0] += 30
    elif kind == "flat":
        l8 = torch.zeros(R, K, G, B) + 1e-3 * torch.randn(R, K, G, B, generator=gen)
    delta = torch.rand(R, K, G, B, generator=gen) * (5.0 if kind == "huge_delta" else 0.05)
    valid = (torch.arange(B) < nfull.unsqueeze(1))[:, None, None, :]
    l8 = torch.where(valid, l8, float("-inf"))
    delta = torch.where(valid, delta, 0.0)
    l_tail = torch.randn(R, K, G, 1, generator=gen)
    lse = torch.logsumexp(torch.cat((l8, l_tail), dim=-1), dim=-1, keepdim=True)
    eta = torch.where(valid[:, :, 0], torch.rand(R, K, B, generator=gen), 0.0).unsqueeze(2)
    rounding = torch.rand(R, K, G, generator=gen) * 1e-4
    v_max = torch.rand(R, K, 1, generator=gen) + 0.5
    ph1 = Phase1(log_mass=l8, mass=torch.exp(l8 - lse), delta=delta, rounding=rounding, valid=valid,
                 num_full=nfull.view(R, 1, 1), v_max=v_max, eta=eta)  # fmt: skip
    return ph1, lse


SELECTION_KINDS = ("random", "ties", "peak", "flat", "huge_delta")
WINDOW_PATH = KernelTuning(select_search=0)  # the sorted window (``select_search`` is the default's path)
SELECTION_SHAPES = ((1, "coverage", 512), (7, "strict", 512), (32, "default", 512), (45, "fast", 16),
                    (64, "paper", 16), (100, "default", 8), (130, "strict", 4))  # fmt: skip


def _selection_cases() -> list:
    """Every shape × kind; the interpreter runs one kind per shape (shape i with kind i mod 5: every shape, every
    kind, both the whole-table and the windowed path, and ``flat``/``huge_delta`` through a window), the GPU
    lane all 35 compiled."""
    return [(kind, *shape) if (i - j) % len(SELECTION_KINDS) == 0 else _gpu_lane(kind, *shape)
            for i, shape in enumerate(SELECTION_SHAPES) for j, kind in enumerate(SELECTION_KINDS)]  # fmt: skip


@pytest.mark.parametrize("kind,B,preset,window", _selection_cases())
def test_selection_kernel_equals_the_torch_reference(kind, B, preset, window, gen):
    """``triton_kernels.select``'s sorted-window path (``select_search=0``) makes the decisions of
    ``select_keys``/``select_values``: the same key and value masks and the same rung-1 flags, block for block
    (K_min/K_max clamps, rung 1, value caps). A window smaller than the table runs the windowed path (a threshold
    by bisection, the keys above it compacted, and the full order when the value greedy runs past the window:
    ``flat``/``huge_delta``)."""
    _check_selection(kind, B, preset, window, gen, WINDOW_PATH)


@pytest.mark.parametrize(
    "kind,B,window",
    [("flat", 100, 16), ("random", 45, 512), ("peak", 130, 8), ("ties", 64, 16), ("huge_delta", 100, 8)],
)
def test_selection_in_one_program_per_head_decides_as_the_reference(kind, B, window, gen):
    """``parts=1`` (keys and values in one program per head, what a large batch launches) makes the reference's
    decisions, on the windowed path (``flat``: rung 1 widens and the value greedy runs past the window; ``peak``,
    ``ties``, ``huge_delta``: the two orders' windows settle after very different numbers of bisection steps) and
    the whole-table one; the tests above run ``parts=2``, the launcher's choice at their 18 heads."""
    from certvllm.triton_kernels.select import select_parts

    assert select_parts(18) == 2 and select_parts(67) == 1  # 132 multiprocessors under the interpreter
    _check_selection(kind, B, "default", window, gen, KernelTuning(select_parts=1, select_search=0))


@pytest.mark.parametrize("kind", SELECTION_KINDS)
@pytest.mark.parametrize("preset,first", [("default", 4), ("coverage", 8)])
def test_selection_first_window_decides_as_the_reference(kind, preset, first, gen):
    """``KernelTuning.select_first_window``: a first window of 4 or 8 sorted positions before the wide one (16
    here; 100 blocks) leaves every decision the reference's, both where K* and the value count fall inside it
    (``peak``: one dominant block) and where the wide window has to decide (``flat``: rung 1 widens;
    ``huge_delta``: the estimate never meets key_tol, K* = K_max)."""
    _check_selection(kind, 100, preset, 16, gen, KernelTuning(select_first_window=first, select_search=0))


@pytest.mark.parametrize("kind,B,preset,window", _selection_cases())
@pytest.mark.parametrize("parts", [1, _gpu_lane(2)])
def test_selection_by_search_decides_as_the_reference(kind, B, preset, window, parts, gen):
    """``KernelTuning.select_search``: the counts found by bisection on the rules themselves (no window, no sort)
    make the reference's decisions on every shape and kind: the budget rule's K* with its clamps and rung 1, the
    coverage rule's base and widening (``coverage``, ``paper``), rung 2's count and its cap (``value_k_max`` 2 on
    even tables), ties broken by block order (``ties``), with both one program per head and keys and values apart."""
    _check_selection(kind, B, preset, window, gen, KernelTuning(select_search=1, select_parts=parts))


def _check_selection(kind, B, preset, window, gen, tuning=None) -> None:
    """The selection kernel's bits and rung-1 flags against ``select_keys``/``select_values`` on a phase-1 summary
    of ``_phase1_summary``'s ``kind`` (3 rows, 2 KV heads, 3 query heads each; the default ``select_parts`` runs 2
    programs per head at these 18 heads)."""
    from certvllm.triton_kernels.select import select_blocks
    from certvllm.triton_kernels.tuning import DEFAULT_TUNING

    from certvllm.attention.selection import select_keys, select_values

    R, K, G = 3, 2, 3
    cfg = load_config(preset, exploration_rate=0.0, k_min=1, k_max=min(B, 5), value_k_max=None if B % 2 else 2)
    # short rows in a wide table (as when vLLM batches a short request with a long one): few valid blocks
    nfull = torch.tensor([B, max(0, B - 3), B // 2]) if B < 130 else torch.tensor([0, 2, B])
    ph1, lse = _phase1_summary(R, K, G, B, nfull, kind, gen)
    key_mask, widened = select_keys(ph1, cfg)
    value_mask = select_values(ph1, key_mask, cfg)
    bits, widened_k = select_blocks(ph1.log_mass.to(DEV), lse.squeeze(-1).to(DEV), ph1.delta.to(DEV),
                                    ph1.rounding.to(DEV), nfull.to(DEV), ph1.eta.squeeze(2).to(DEV),
                                    ph1.v_max.squeeze(-1).to(DEV), cfg.ladder, window=window,
                                    tuning=tuning or DEFAULT_TUNING)  # fmt: skip
    shifts = torch.arange(G).view(1, 1, G, 1)
    bits = bits.cpu().unsqueeze(2)
    assert torch.equal(((bits >> shifts) & 1).bool(), key_mask)
    assert torch.equal(((bits >> (shifts + G)) & 1).bool(), value_mask)
    assert torch.equal(widened_k.cpu(), widened)


@pytest.mark.parametrize(
    "family,preset,overrides",
    [
        ("random", "default", {}),  # the interpreter's case: every glue kernel (prepare, selection, epilogue)
        _gpu_lane("near_tied_blocks", "strict", {"rank_depth": 3}),
        _gpu_lane("retrieval_peaks", "paper", {"exploration_rate": 0.2}),
        _gpu_lane("outlier_channels", "naive", {}),
        _gpu_lane("sink_and_recency", "default", {"force_fallback": "head"}),
        _gpu_lane("one_hot", "fast", {"bound_tol": 1e-6}),
    ],
)
def test_glue_kernels_equal_the_torch_path(family, preset, overrides, gen):
    """The whole layer call with the glue kernels (prepare, selection, epilogue) against the same call with
    their torch references (``CudaOptions(glue="torch")``): identical selections, rungs, flags and counts (the
    report's, and the page-in engine's promotion traffic); outputs and bound terms equal to the rounding of the
    float64/float32 sums whose order differs (1e-6 relative), except the terms that go through
    ᾱ_T = exp(2(Δ+R) + log α): an ulp of an exponent of magnitude ~30 moves the result by ~30·2^-23 relative,
    so 1e-5 there."""
    cases = [make_case(family, t, 8, 2, 64, torch.float16, gen) for t in (5, 40, 130, 203)]
    cfg = load_config(preset, **overrides)
    cache, tables, lens = paged_batch(cases, cfg.value_group_size)
    q = torch.stack([c.q for c in cases]).to(DEV)
    dcache = _to_device(cache)
    runs, traffic = [], []
    for glue in ("torch", "auto"):
        g = torch.Generator(device=DEV.type).manual_seed(7)
        eng = CudaPageInEngine(DEV)
        call = partial(_call, dcache, q, tables.to(DEV), lens.to(DEV), cfg, generator=g, pagein=eng,
                       cuda_options=CudaOptions(glue=glue, blocks_per_split=3))  # fmt: skip
        runs.append(run_with_exact(call, q.cpu(), cache, tables, lens, 1 / 8))
        stats = eng.take_stats()
        traffic.append((stats.key_blocks, stats.value_blocks, stats.bytes))
    (ref, ref64), (got, got64) = runs
    assert traffic[1] == traffic[0]  # the epilogue's promotion counts are the torch sums
    assert torch.equal(got64, ref64)  # the same selection: the same computation
    assert_within_lowp_error(got.out.cpu(), ref64, ref.out.cpu(), factor=FACTOR, atol=ULP * _vmax(cases),
                             what=f"glue kernels, {family}/{preset}")  # fmt: skip
    for name in ("rung", "k_star", "v_promoted", "rank_fail", "boundary_fail", "bound_fail", "canary_fail",
                 "precondition"):  # fmt: skip
        assert torch.equal(getattr(got.report, name), getattr(ref.report, name)), name
    for name in ("e_key", "e_val", "e_round", "v_max", "delta_tail", "alpha_tail"):
        rtol = 1e-5 if name in ("e_key", "alpha_tail") else 1e-6
        torch.testing.assert_close(getattr(got.report, name), getattr(ref.report, name), rtol=rtol, atol=0.0,
                                   msg=name)  # fmt: skip
    # the partial block's scores are D-term float32 sums in another order (a few ulp), which moves its
    # softmax weights by as much: outputs to 1e-6 of the largest value
    vmax = max(float(c.v.abs().max()) for c in cases)
    torch.testing.assert_close(got.out, ref.out, rtol=1e-5, atol=1e-6 * vmax)


# -- the device-resident promotion cache (certvllm.kv.promotion_cache) -------------------------------------
@_cuda_only
@pytest.mark.parametrize("sub,channel_major", [(1, False), (4, False), (4, True)])
def test_pool_fill_copies_key_pages_from_the_shadow(sub, channel_major, gen):
    from certvllm.triton_kernels.gather import fill_pool

    lay = PageLayout(64)
    shadow = torch.randn(5, 3, 2, sub * BLOCK_SIZE, 64, generator=gen).bfloat16()
    cache = LayerKVCache(torch.zeros(5, 3, sub * lay.page_bytes, dtype=torch.uint8, device=DEV), shadow, lay,
                         keys_channel_major=channel_major)  # fmt: skip
    shadow = ensure_device_readable(cache)  # registered with CUDA on a GPU machine, as the layer call does
    pool = torch.full((4, BLOCK_SIZE, 64), 7.0, dtype=torch.bfloat16, device=DEV)
    ids, heads = torch.tensor([5 * sub - 1, 0, 3]), torch.tensor([1, 2, 0])
    fill = torch.tensor([ids[0] * 3 + heads[0], -1, ids[1] * 3 + heads[1], ids[2] * 3 + heads[2]])
    fill_pool(pool, shadow, fill.to(DEV), 3, sub, channel_major)
    keys = cache.shadow_pages(ids, heads)[:, 0]
    assert torch.equal(pool[[0, 2, 3]].cpu(), keys) and (pool[1] == 7.0).all()  # slot 1 left alone


def _check_resident_pool(pool, cache, tables, nfull, bits, need_mask) -> set[int]:
    """The invariants of an explicitly allocated pool (``ResidentPool``) after a lookup; returns the pages it
    serves. A page is served iff slot_of → a slot tagged (page, the block's generation); served slots hold the
    shadow's keys and values; no two pages share a slot."""
    H = cache.num_kv_heads
    slot_of, tag, tag_gen = pool.slot_of.cpu().long(), pool.tag.cpu(), pool.tag_gen.cpu()
    gen_ = pool.generation.cpu()
    served = {}
    for e in range(slot_of.numel()):
        s_ = int(slot_of[e])
        assert s_ >= -1  # no claim survives a call
        if s_ >= 0 and int(tag[s_]) == e and int(tag_gen[s_]) == int(gen_[e // H]):
            served[e] = s_
    assert len(set(served.values())) == len(served)
    if served:
        pages, slots = torch.tensor(list(served)), torch.tensor(list(served.values()))
        orig = cache.shadow_pages(pages // H, pages % H)  # [n, 2, N, D]
        assert torch.equal(pool.pool.cpu()[slots], orig[:, 0]) and torch.equal(pool.values.cpu()[slots], orig[:, 1])
    R, _, B = bits.shape
    valid = torch.arange(B) < nfull.cpu().unsqueeze(1)
    need = valid.unsqueeze(1) & ((bits.cpu() & need_mask) != 0)
    wanted = {int(tables.cpu()[r, b]) * H + h for r, h, b in need.nonzero().tolist()}
    return set(served) & wanted


def need_items(tables, nfull, bits, need_mask) -> list[list[int]]:
    """The (row, KV head, block) items a lookup with these bits needs (full blocks with ``bits & need_mask``)."""
    B = bits.shape[2]
    valid = torch.arange(B) < nfull.cpu().unsqueeze(1)
    return (valid.unsqueeze(1) & ((bits.cpu() & need_mask) != 0)).nonzero().tolist()


@pytest.mark.parametrize("slots", [64, 3])
def test_resident_pool_pages_in_keeps_and_evicts(slots, gen):
    """``ResidentPool.lookup``: every wanted page is served afterwards (or, past the pool's size, counted as
    bypass), a second lookup of the same pages only hits (with too few slots: nothing it needs is evicted), a
    rewritten block is refilled in place, and eviction by the FIFO hand takes a page's slot away cleanly."""
    from certvllm.kv.promotion_cache import ResidentPool

    lay = PageLayout(64)
    E, H, G = 12, 2, 2
    shadow = torch.randn(E, H, 2, BLOCK_SIZE, 64, generator=gen).half()
    cache = LayerKVCache(torch.zeros(E, H, lay.page_bytes, dtype=torch.uint8, device=DEV), shadow, lay)
    pool = ResidentPool(cache, slots)
    tables = torch.tensor([[3, 7, 1, 9, 4], [7, 2, 8, 0, 5]]).to(DEV)  # block 7 shared by both rows
    nfull = torch.tensor([5, 4]).to(DEV)
    bits = torch.zeros(2, H, 5, dtype=torch.int32)
    bits[0, 0, :4], bits[1, :, 0], bits[1, 1, 2:] = 1, 2, 3  # (bits beyond nfull are not needed)
    bits = bits.to(DEV)
    wanted = 4 + 2 + 2 - 1  # items: row 0 head 0 ×4, row 1 block 7 ×2 heads, row 1 head 1 ×2; (7, 0) twice
    _, paged = pool.lookup(cache, tables, nfull, bits, (1 << G) - 1)
    got = _check_resident_pool(pool, cache, tables, nfull, bits, (1 << G) - 1)
    st = pool.take_stats()
    assert st["lookups"] == wanted + 1 and st["hits"] == 0  # page (7, 0) is needed twice, paged in once
    if slots >= wanted:
        assert len(got) == wanted and st["fills"] == wanted and st["bypass"] == 0 and int(paged) == wanted
        pool.lookup(cache, tables, nfull, bits, (1 << G) - 1)
        assert pool.take_stats() == {"lookups": wanted + 1, "hits": wanted + 1, "fills": 0, "bypass": 0}
        cache.bump_generation(torch.tensor([7]))  # block 7 rewritten: its pages refill in place
        before = pool.slot_of.clone()
        pool.lookup(cache, tables, nfull, bits, (1 << G) - 1)
        assert pool.take_stats()["fills"] == 2 and torch.equal(pool.slot_of, before)  # (7, 0) and (7, 1)
        assert len(_check_resident_pool(pool, cache, tables, nfull, bits, (1 << G) - 1)) == wanted
    else:  # more wanted pages than slots: 3 served, the rest bypass
        assert len(got) == slots and st["fills"] == slots and st["bypass"] == wanted - slots
        first = set(got)
        in_order = [int(tables[r, b]) * H + h for r, h, b in need_items(tables, nfull, bits, (1 << G) - 1)]
        assert first == set(list(dict.fromkeys(in_order))[:slots])  # slots go to the first pages in item order
        # the same pages again: the resident ones are pinned by the call that needs them, so nothing is evicted
        pool.lookup(cache, tables, nfull, bits, (1 << G) - 1)
        again = _check_resident_pool(pool, cache, tables, nfull, bits, (1 << G) - 1)
        assert again == first
        items = need_items(tables, nfull, bits, (1 << G) - 1)
        hits = sum(int(tables[r, b]) * H + h in first for r, h, b in items)  # items: page (7, 0) may count twice
        assert pool.take_stats() == {"lookups": wanted + 1, "hits": hits, "fills": 0, "bypass": wanted - slots}
        # a call that needs only the others: the hand evicts the oldest tenants (needed by nobody now)
        others = bits.cpu().clone()
        for r, h, b in items:
            if int(tables[r, b]) * H + h in first:
                others[r, h, b] = 0
        others = others.to(DEV)
        pool.lookup(cache, tables, nfull, others, (1 << G) - 1)
        later = _check_resident_pool(pool, cache, tables, nfull, others, (1 << G) - 1)
        assert len(later) == slots and not (later & first)


def _lookup_inputs(gen: torch.Generator, step: int, blocks: int, H: int, G: int, density: float):
    """One step of the pool-lookup tests: 2 rows of 5 blocks out of ``blocks`` (every 4th step the rows share their
    first 3: a prefix-cache hit, items of the same page), 5 and 3 full blocks, random promotion bits on about
    ``density`` of the (row, KV head, block) items, and the need mask alternating between key bits and any bit.
    Returns ``(tables, nfull, bits, need_mask, shared)``."""
    tables = torch.randperm(blocks, generator=gen)[:10].view(2, 5)
    shared = step % 4 == 3
    if shared:
        tables[1, :3] = tables[0, :3]
    nfull = torch.tensor([5, 3]).to(DEV)
    bits = torch.randint(0, 1 << (2 * G), (2, H, 5), generator=gen).to(torch.int32)
    bits = torch.where(torch.rand(2, H, 5, generator=gen) < density, bits, 0).to(DEV)
    return tables.to(DEV), nfull, bits, -1 if step % 2 else (1 << G) - 1, shared


def _assert_pools_hold_the_same_pages(pools, cache: LayerKVCache) -> None:
    """Two pools after the same lookups: the same tags and generation tags, the same bytes in every filled slot,
    and each filled slot holding its page's keys from the shadow."""
    H = cache.num_kv_heads
    for name in ("tag", "tag_gen"):
        assert torch.equal(getattr(pools[0], name), getattr(pools[1], name)), name
    filled = pools[0].tag >= 0
    assert torch.equal(pools[0].pool[filled], pools[1].pool[filled])
    pages = pools[0].tag[filled].cpu()
    assert torch.equal(pools[0].pool[filled].cpu(), cache.shadow_pages(pages // H, pages % H)[:, 0])


@_cuda_only
@pytest.mark.parametrize("sub,channel_major", [(1, False), (2, True)])
def test_pool_lookup_kernels_equal_the_torch_reference(sub, channel_major, gen):
    from certvllm.kv.promotion_cache import PromotionCache

    lay = PageLayout(64)
    E, H, G = 12 // sub, 2, 2
    shadow = torch.randn(E, H, 2, sub * BLOCK_SIZE, 64, generator=gen).half()
    cache = LayerKVCache(torch.zeros(E, H, sub * lay.page_bytes, dtype=torch.uint8, device=DEV), shadow, lay,
                         keys_channel_major=channel_major)  # fmt: skip
    pools = [PromotionCache(cache, 5) for _ in range(2)]
    for step in range(8):
        tables, nfull, bits, need_mask, _ = _lookup_inputs(gen, step, 12, H, G, 0.5)
        out = [pools[0].lookup(cache, tables, nfull, bits, need_mask),
               pools[1].lookup_reference(cache, tables, nfull, bits, need_mask)]  # fmt: skip
        assert torch.equal(out[0][0], out[1][0]) and int(out[0][1]) == int(out[1][1])
        assert bool((pools[0].claims == -1).all()), "a lookup leaves its claim arrays as it found them"
        assert torch.equal(pools[0].counts, pools[1].counts)
        _assert_pools_hold_the_same_pages(pools, cache)
        cache.bump_generation(torch.randint(0, 12, (2,), generator=gen))
    st = pools[0].take_stats()
    assert st["hits"] > 0 and st["fills"] > 0 and st["bypass"] > 0


def test_write_through_pool_lookup_equals_the_hashed_reference(gen, monkeypatch):
    """A write-through pool (one slot per page) takes the claim-free lookup (``pool._direct_lookup``); the torch
    reference runs the hashed pool's claims on the same pool. Page e's slot is e either way, so every slot map, tag,
    generation tag and filled page is the same, bit for bit, over steps with hits, misses, rewritten blocks (their
    slot is refilled) and rows sharing blocks. Counts: equal, except that where two rows need the same missing page
    each may list it (the reference fills it once): pages needed and bypassed (0) still equal, hits + fills =
    pages needed."""
    from certvllm.triton_kernels import pool as pool_kernels

    from certvllm.kv.promotion_cache import PromotionCache

    lay = PageLayout(64)
    E, H, G = 12, 2, 2
    shadow = torch.randn(E, H, 2, BLOCK_SIZE, 64, generator=gen).half()
    cache = LayerKVCache(torch.zeros(E, H, lay.page_bytes, dtype=torch.uint8, device=DEV), shadow, lay)
    pools = [PromotionCache(cache, E * H) for _ in range(2)]
    assert pools[0].write_through

    def no_claims(*args):
        raise AssertionError("a write-through pool's lookup ran the claims")

    monkeypatch.setattr(pool_kernels, "_claims", no_claims)
    for step in range(8):
        tables, nfull, bits, need_mask, shared = _lookup_inputs(gen, step, E, H, G, 0.6)
        before = pools[0].counts.clone()
        got = pools[0].lookup(cache, tables, nfull, bits, need_mask)
        want = pools[1].lookup_reference(cache, tables, nfull, bits, need_mask)
        assert torch.equal(got[0], want[0])
        _assert_pools_hold_the_same_pages(pools, cache)
        assert bool((pools[0].claims == -1).all()), "the direct lookup does not touch the claim arrays"
        mine = (pools[0].counts - before).cpu()
        if not shared:
            assert torch.equal(pools[0].counts, pools[1].counts), step
        else:
            assert int(mine[3]) == 0 and int(mine[0]) == int(mine[1]) + int(mine[2])
            pools[1].counts.copy_(pools[0].counts)  # the totals go on from the same point
        cache.bump_generation(torch.randint(0, E, (2,), generator=gen))
    st = pools[0].take_stats()
    assert st["hits"] > 0 and st["fills"] > 0 and st["bypass"] == 0


def _assert_identical(a, b) -> None:
    assert torch.equal(a.out, b.out)
    for field in ("rung", "k_star", "v_promoted", "e_key", "e_val", "e_round"):
        assert torch.equal(getattr(a.report, field), getattr(b.report, field)), field


@_cuda_only
@pytest.mark.parametrize("fraction", [1.0, 0.05])
def test_promotion_cache_hits_are_bit_identical_to_no_cache(fraction, gen):
    cases = [make_case("sink_and_recency", t, 8, 2, 64, torch.float16, gen) for t in (130, 261)]
    cache, tables, lens = paged_batch(cases)
    tables, lens = tables.to(DEV), lens.to(DEV)
    q = torch.stack([c.q for c in cases]).to(DEV)
    off = load_config("default", promotion_cache_fraction=0.0)
    on = load_config("default", promotion_cache_fraction=fraction)
    plain, pooled = _to_device(cache), _to_device(cache)
    assert Residency.for_layer(plain, off.promotion_cache_fraction).pool is None  # disabled: nothing allocated
    res = Residency.for_layer(pooled, on.promotion_cache_fraction)
    cold = _call(pooled, q, tables, lens, on, res)
    pc = res.pool
    st = pc.take_stats()
    assert st["hits"] == 0 and st["fills"] > 0 and st["lookups"] == st["fills"] + st["bypass"]
    _assert_identical(cold, _call(plain, q, tables, lens, off))
    for step in range(2):  # the same step again, then drifted queries
        qs = q if step == 0 else (q.float() + 0.2 * torch.randn(q.shape, generator=gen).to(DEV)).half()
        _assert_identical(_call(pooled, qs, tables, lens, on, res), _call(plain, qs, tables, lens, off))
        st = pc.take_stats()
        assert st["hits"] > 0
        if fraction == 1.0:  # one slot per page: no conflicts, a repeated step is all hits
            assert st["bypass"] == 0 and (step > 0 or st["hits"] == st["lookups"])
        else:
            assert st["bypass"] > 0  # 3 slots for 54 pages: conflicts, served from the shadow


def test_rerun_slot_map_holds_exactly_the_current_copies(gen):
    """``rerun_inputs`` with a write-through pool: the re-run's slot map is the page id where the group is active,
    the block full and the slot's tag (page, generation) equal to (page, the block's current generation), else −1;
    its bits, active flags and canary are those of the call without a pool."""
    from certvllm.triton_kernels.phase2_glue import rerun_inputs

    R, K, B, NB = 3, 2, 7, 11  # G = 2 query heads per KV head (the four columns of the rungs)
    rung = torch.tensor([[3, 2, 0, 1], [2] * 4, [4, 3, 3, 4]], dtype=torch.int8).to(DEV)  # row 1: none escalated
    nfull = torch.tensor([7, 3, 0]).to(DEV)
    tables = torch.randint(0, NB, (R, B), generator=gen).to(DEV)
    generation = torch.randint(0, 3, (NB,), generator=gen).to(DEV)
    pages = torch.arange(NB * K).to(DEV)
    tag = torch.where(torch.rand(NB * K, generator=gen).to(DEV) < 0.8, pages, -1)
    tag_gen = torch.where(torch.rand(NB * K, generator=gen).to(DEV) < 0.7, generation.repeat_interleave(K),
                          generation.repeat_interleave(K) - 1)  # fmt: skip
    bits, active, canary, kslot = rerun_inputs(rung, nfull, K, B, (tables, tag, tag_gen, generation, NB))
    plain = rerun_inputs(rung, nfull, K, B)
    assert plain[3] is None and all(torch.equal(a, b) for a, b in zip(plain[:3], (bits, active, canary), strict=True))
    page = tables.unsqueeze(1) * K + torch.arange(K, device=DEV).view(1, K, 1)  # [R, K, B]
    held = (tag[page] == page) & (tag_gen[page] == generation[tables].unsqueeze(1))
    live = (torch.arange(B, device=DEV) < nfull.view(R, 1, 1)) & (active.view(R, K, 1) != 0)
    want = torch.where(live & held, page, -1).to(torch.int32)
    assert torch.equal(kslot, want)
    assert bool((want >= 0).any()) and bool(((want < 0) & live).any())  # both cases occur
    assert bool((held[1] & (torch.arange(B, device=DEV) < nfull[1])).any())  # and held pages of inactive groups


def _written_twice(cases, cfg):
    """The batch of ``cases`` written token by token through the device write path into two fresh caches: one with
    a write-through pool (``cfg``'s fraction, 1.0: one slot per page) and one without. Returns
    ``(pooled, its residency, bare, tables, lens)``."""
    from certvllm.kv.cuda_pagein import write_tokens_on_device

    batch, tables, lens = paged_batch(cases)
    E, H, m = batch.shadow.shape[0], batch.num_kv_heads, batch.sub_blocks
    keys, values, slots = [], [], []
    for r, n in enumerate(lens.tolist()):
        for j in range(-(-n // BLOCK_SIZE)):
            b = int(tables[r, j])
            kv = batch.shadow_pages(torch.full((H,), b), torch.arange(H))  # [H, 2, 16, D]
            t = min(BLOCK_SIZE, n - j * BLOCK_SIZE)
            keys.append(kv[:, 0, :t].transpose(0, 1))
            values.append(kv[:, 1, :t].transpose(0, 1))
            slots.append(b * BLOCK_SIZE + torch.arange(t))
    caches, residencies = [], []
    for fraction in (cfg.promotion_cache_fraction, 0.0):
        shadow = torch.zeros(E, H, 2, m * BLOCK_SIZE, batch.layout.head_dim, dtype=batch.shadow.dtype)
        cache = LayerKVCache(torch.zeros_like(batch.pages, device=DEV), shadow, batch.layout)
        res = Residency.for_layer(cache, fraction)
        write_tokens_on_device(cache, torch.cat(keys).to(DEV), torch.cat(values).to(DEV), torch.cat(slots).to(DEV),
                               res.pool)  # fmt: skip
        caches.append(cache)
        residencies.append(res)
    assert residencies[0].pool.write_through and residencies[1].pool is None
    assert torch.equal(caches[0].pages, caches[1].pages) and torch.equal(caches[0].shadow, caches[1].shadow)
    return caches[0], residencies[0], caches[1], tables.to(DEV), lens.to(DEV)


@_cuda_only
def test_write_through_pool_serves_first_promotions_from_vram(gen):
    """Two caches written token by token through the device write path, one with a write-through pool (one slot
    per page), one without: the same pages, and a first certified call that reads every promoted key page from
    the pool (no fill, no bypass: no key page over PCIe) with outputs and reports bit-identical to the call
    without a pool."""
    cfg = load_config("default", promotion_cache_fraction=1.0)
    off = cfg.model_copy(update={"promotion_cache_fraction": 0.0})
    cases = [make_case("sink_and_recency", t, 8, 2, 64, torch.float16, gen) for t in (130, 261)]
    pooled, res, bare, tables, lens = _written_twice(cases, cfg)
    q = torch.stack([c.q for c in cases]).to(DEV)
    out = _call(pooled, q, tables, lens, cfg, res)
    st = res.pool.take_stats()
    assert st["lookups"] > 0 and st["hits"] == st["lookups"] and st["fills"] == 0 and st["bypass"] == 0
    _assert_identical(out, _call(bare, q, tables, lens, off))


@_cuda_only
def test_exact_rerun_reads_a_write_through_pool(gen, monkeypatch):
    """A row forced exact (rung 4) over a cache written through a write-through pool: the re-run's promotion pass
    gets a slot map that holds every full block of that row (its keys read in VRAM) and none of the other row's,
    and the outputs equal the call without a pool bit for bit."""
    from certvllm.attention import gpu as gpu_path

    cfg = load_config("default", promotion_cache_fraction=1.0)
    off = cfg.model_copy(update={"promotion_cache_fraction": 0.0})
    cases = [make_case("sink_and_recency", t, 8, 2, 64, torch.float16, gen) for t in (130, 261)]
    pooled, res, bare, tables, lens = _written_twice(cases, cfg)
    q = torch.stack([c.q for c in cases]).to(DEV)
    slot_maps, promote = [], gpu_path.promote

    def spy(*args, **kwargs):  # kwargs: the re-run's exact_rerun=True
        slot_maps.append(args[14] if len(args) > 14 else None)
        return promote(*args, **kwargs)

    monkeypatch.setattr(gpu_path, "promote", spy)
    force = torch.tensor([False, True], device=DEV)
    out = _call(pooled, q, tables, lens, cfg, res, force_exact=force)
    rerun = slot_maps[-1]  # the main pass's first, then the re-run's
    assert len(slot_maps) == 2 and rerun is not None
    nfull = int(lens[1]) // BLOCK_SIZE
    assert bool((rerun[1, :, :nfull] >= 0).all()) and bool((rerun[1, :, nfull:] == -1).all())
    assert bool((rerun[0] == -1).all())
    _assert_identical(out, _call(bare, q, tables, lens, off, force_exact=force))


def test_the_exact_rerun_never_asks_for_the_cuda_promotion_kernel(gen, monkeypatch):
    """With ``promote_cuda=4``, a call with one row forced exact (rung 4) asks whether to run the CUDA promotion
    kernel for its main pass only: the rung-3/4 re-run takes the Triton kernel, whose tree sums keep the exact
    rungs within the dense path's rounding (``phase2.promote``'s ``exact_rerun``; the CUDA kernel's FMA chains
    are less accurate at huge norms). The forced row is the dense result within the float32 rule."""
    from certvllm.triton_kernels import phase2

    from certvllm.attention import gpu as gpu_path

    asked, reruns = [], []
    real_use, real_promote = phase2.use_cuda_promote, gpu_path.promote

    def use_spy(geo, device):
        asked.append(geo.tuning.promote_cuda)
        return real_use(geo, device)

    def promote_spy(*args, **kw):
        reruns.append(kw.get("exact_rerun", False))
        return real_promote(*args, **kw)

    monkeypatch.setattr(phase2, "use_cuda_promote", use_spy)
    monkeypatch.setattr(gpu_path, "promote", promote_spy)
    cfg = load_config("default", kernel_tuning="promote_cuda=4")
    cases = [make_case("retrieval_peaks", t, 8, 2, 64, torch.float16, gen) for t in (130, 75)]
    cache, tables, lens = paged_batch(cases, cfg.value_group_size)
    q = torch.stack([c.q for c in cases]).to(DEV)
    force = torch.tensor([False, True], device=DEV)
    res = _call(_to_device(cache), q, tables.to(DEV), lens.to(DEV), cfg, force_exact=force)
    assert reruns == [False, True]  # the main pass, then the re-run
    assert asked == [4]  # only the main pass asked for the CUDA kernel
    assert bool((res.report.rung[1] == 4).all())
    c = cases[1]
    qc, kc, vc = c.q.to(DEV), c.k.to(DEV), c.v.to(DEV)
    scale = 1 / math.sqrt(64)
    assert_within_lowp_error(res.out[1], exact_attention(qc, kc, vc, scale), dense_decode(qc, kc, vc, scale),
                             factor=FACTOR, atol=ULP * _vmax([c]), what="forced row")  # fmt: skip


@_cuda_only
def test_promotion_cache_never_serves_a_rewritten_block(gen, monkeypatch):
    # the canary is off so that a stale key page could not be caught (and recomputed exactly) by rung 4
    cfg = load_config("default", promotion_cache_fraction=1.0, canary=False)
    off = cfg.model_copy(update={"promotion_cache_fraction": 0.0})
    cases = [make_case("sink_and_recency", 200, 8, 2, 64, torch.float16, gen) for _ in range(2)]
    cache, tables, lens = paged_batch(cases)
    tables, lens = tables.to(DEV), lens.to(DEV)
    q = torch.stack([c.q for c in cases]).to(DEV)
    pooled = _to_device(cache)
    res = Residency.for_layer(pooled, cfg.promotion_cache_fraction)
    first = _call(pooled, q, tables, lens, cfg, res)
    pc = res.pool
    assert pc.take_stats()["fills"] > 0
    pos = torch.arange(12 * BLOCK_SIZE)  # every full block of row 0
    slots = tables[0, pos // BLOCK_SIZE].cpu() * BLOCK_SIZE + pos % BLOCK_SIZE

    def rewrite() -> None:  # the same tokens, perturbed: the selection stays much the same
        k, v = cases[0].k[: pos.numel()], cases[0].v[: pos.numel()]
        pooled.write((k.float() + 0.5 * torch.randn(k.shape, generator=gen)).half(), v, slots)

    rewrite()
    again = _call(pooled, q, tables, lens, cfg, res)
    fresh = LayerKVCache(pooled.pages, pooled.shadow, pooled.layout)  # no pool: the reference
    _assert_identical(again, _call(fresh, q, tables, lens, off))
    assert not torch.equal(again.out[0], first.out[0])  # the rewrite changed row 0's output
    assert torch.equal(again.out[1], first.out[1])
    st = pc.take_stats()
    assert 0 < st["hits"] < st["lookups"]  # row 1 hit, row 0's rewritten pages were filled again
    # control: with the generation bump disabled the same construction does serve stale keys, which this
    # test would catch
    monkeypatch.setattr(LayerKVCache, "bump_generation", lambda self, ids: None)
    rewrite()
    stale = _call(pooled, q, tables, lens, cfg, res)
    assert not torch.equal(stale.out[0], _call(fresh, q, tables, lens, off).out[0])


# -- the step prefetch (certvllm.kv.prefetch) ------------------------------------------------------------
@_cuda_only
@pytest.mark.parametrize("sub,channel_major,sparse", [(1, False, 0), (4, True, 0), (1, False, 100)])
def test_stage_pages_copies_the_listed_pages(sub, channel_major, sparse, gen):
    from certvllm.triton_kernels.prefetch import stage_pages

    lay = PageLayout(64)
    shadow = torch.randn(5, 3, 2, sub * BLOCK_SIZE, 64, generator=gen).half()
    cache = LayerKVCache(torch.zeros(5, 3, sub * lay.page_bytes, dtype=torch.uint8, device=DEV), shadow, lay,
                         keys_channel_major=channel_major)  # fmt: skip
    shadow = ensure_device_readable(cache)
    dst = torch.full((6, BLOCK_SIZE, 64), 7.0, dtype=torch.float16, device=DEV)
    ids, heads = torch.tensor([5 * sub - 1, 0, 3, 2]), torch.tensor([1, 2, 0, 0])
    pages = torch.tensor([ids[0] * 3 + heads[0], -1, ids[1] * 3 + heads[1], ids[2] * 3 + heads[2],
                          ids[3] * 3 + heads[3], 0])  # fmt: skip
    # sparse = 100 > 5 listed pages: one of the two programs copies them all
    stage_pages(dst, shadow, pages.to(DEV), torch.tensor([5]).to(DEV), 3, sub, channel_major, programs=2,
                per_iteration=2, sparse=sparse)  # fmt: skip
    keys = cache.shadow_pages(ids, heads)[:, 0]
    assert torch.equal(dst[[0, 2, 3, 4]].cpu(), keys)
    assert (dst[1] == 7.0).all() and (dst[5] == 7.0).all()  # a −1 entry and an entry past the count


def _prefetch_layers(cases, n_layers, cfg):
    """``n_layers`` layer caches over the same tokens (each its own pages, pool and generations) registered
    with one step prefetcher, their residencies, and the same layers without either (the reference)."""
    from certvllm.kv.prefetch import StepPrefetcher

    cache, tables, lens = paged_batch(cases)
    layers = [_to_device(cache) for _ in range(n_layers)]
    plain = [_to_device(cache) for _ in range(n_layers)]
    pf = StepPrefetcher.for_cache(layers[0], cfg.prefetch_fraction)
    residencies = [Residency.for_layer(lay, cfg.promotion_cache_fraction) for lay in layers]
    for lay, res in zip(layers, residencies, strict=True):
        res.prefetcher, res.prefetch_index = pf, pf.register(lay)
    return pf, layers, residencies, plain, tables.to(DEV), lens.to(DEV)


@_cuda_only
@pytest.mark.parametrize("n_layers", [2, 3])  # 2: the last layers stage the next step's first ones
def test_step_prefetch_serves_staged_pages_and_changes_nothing(n_layers, gen):
    # a pool far too small for the promoted pages: most of them are left to the shadow, i.e. staged
    cfg = load_config("default", promotion_cache_fraction=0.05, prefetch_fraction=0.5)
    cases = [make_case("sink_and_recency", t, 8, 2, 64, torch.float16, gen) for t in (100, 181)]
    pf, layers, res, plain, tables, lens = _prefetch_layers(cases, n_layers, cfg)
    plain_res = [Residency.for_layer(p, cfg.promotion_cache_fraction) for p in plain]  # pools, no prefetch
    q0 = torch.stack([c.q for c in cases]).to(DEV)
    for step in range(2):
        pf.begin_step()
        for i in range(n_layers):
            q = (q0.float() + 0.1 * (step + i) * torch.randn(q0.shape, generator=gen).to(DEV)).half()
            ref = _call(plain[i], q, tables, lens, cfg, plain_res[i])
            _assert_identical(_call(layers[i], q, tables, lens, cfg, res[i]), ref)
        pf.end_step()
        st = pf.take_stats()
        assert st["candidates"] > 0 and st["staged"] > 0
        if step == 0:
            assert st["served"] == 0  # nothing was listed before the first step
        else:
            assert st["served"] > 0
    assert pf.nbytes == pf.ring.numel() * 2 + 16 * pf.ring.shape[0] * pf.capacity


@_cuda_only
def test_step_prefetch_follows_rows_when_the_batch_changes(gen):
    # step 0 serves rows A, B, C; then B finishes and the engine compacts the batch to C, A with a narrower
    # block table: each row keeps its staged pages (matched by its first block), the output is unchanged
    cfg = load_config("default", promotion_cache_fraction=0.05, prefetch_fraction=0.5)
    cases = [make_case("sink_and_recency", t, 8, 2, 64, torch.float16, gen) for t in (100, 181, 70)]
    pf, layers, res, plain, tables, lens = _prefetch_layers(cases, 2, cfg)
    plain_res = [Residency.for_layer(p, cfg.promotion_cache_fraction) for p in plain]
    q = torch.stack([c.q for c in cases]).to(DEV)
    for rows in ([0, 1, 2], [2, 0]):
        idx = torch.tensor(rows, device=DEV)
        width = int((lens[idx].max() + BLOCK_SIZE - 1) // BLOCK_SIZE)
        t, n, qq = tables[idx, :width].contiguous(), lens[idx], q[idx]
        pf.begin_step()
        for i in range(2):
            _assert_identical(_call(layers[i], qq, t, n, cfg, res[i]), _call(plain[i], qq, t, n, cfg, plain_res[i]))
        pf.end_step()
        st = pf.take_stats()
        assert st["candidates"] > 0 and (st["served"] > 0) == (rows == [2, 0])


@_cuda_only
def test_step_prefetch_never_serves_a_rewritten_block(gen, monkeypatch):
    cfg = load_config("default", promotion_cache_fraction=0.05, prefetch_fraction=1.0, canary=False)
    cases = [make_case("sink_and_recency", 200, 8, 2, 64, torch.float16, gen) for _ in range(2)]
    pf, layers, res, plain, tables, lens = _prefetch_layers(cases, 1, cfg)
    plain_res = Residency.for_layer(plain[0], cfg.promotion_cache_fraction)
    q = torch.stack([c.q for c in cases]).to(DEV)
    _call(layers[0], q, tables, lens, cfg, res[0])
    pf.take_stats()
    pos = torch.arange(12 * BLOCK_SIZE)  # every full block of row 0
    slots = tables[0, pos // BLOCK_SIZE].cpu() * BLOCK_SIZE + pos % BLOCK_SIZE

    def rewrite() -> None:  # after the staging was taken: the same tokens, perturbed, in both copies
        k, v = cases[0].k[: pos.numel()], cases[0].v[: pos.numel()]
        k2 = (k.float() + 0.5 * torch.randn(k.shape, generator=gen)).half()
        for c in (layers[0], plain[0]):
            c.write(k2, v, slots)

    pf.begin_step()  # stages row 0's and row 1's pages
    rewrite()
    _assert_identical(_call(layers[0], q, tables, lens, cfg, res[0]), _call(plain[0], q, tables, lens, cfg, plain_res))
    st = pf.take_stats()
    assert 0 < st["served"] < st["candidates"]  # row 1's staged pages served, row 0's refused
    # control: without the generation bump the staging's stale copies of row 0 are served and change the output
    monkeypatch.setattr(LayerKVCache, "bump_generation", lambda self, ids: None)
    pf.begin_step()
    rewrite()
    stale = _call(layers[0], q, tables, lens, cfg, res[0])
    assert not torch.equal(stale.out[0], _call(plain[0], q, tables, lens, cfg, plain_res).out[0])


@triton.jit
def _sigma_kernel(codes, exps, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    c = tl.load(codes + i, mask=m, other=0)
    e = tl.load(exps + i, mask=m, other=0)
    tl.store(out + i, key_scale_sigma(c, e), mask=m)


def test_key_scale_sigma_equals_the_table_bit_for_bit():
    """The resident pass forms σ = LUT[code]·2^E without a table gather (``common.key_scale_sigma``): every code, at
    exponents from the clamp limits to beyond them, must give the reference's float32 value exactly."""
    exps = torch.tensor([-130, -126, -125, -40, -7, 0, 3, 20, 120, 127, 130], dtype=torch.int32)
    codes = torch.arange(256, dtype=torch.int32).repeat(exps.numel())
    ex = exps.repeat_interleave(256)
    out = torch.empty(codes.numel(), dtype=torch.float32, device=DEV)
    _sigma_kernel[(triton.cdiv(codes.numel(), 256),)](codes.to(DEV), ex.to(DEV), out, codes.numel(), BLOCK=256)
    ref = key_scale_lut()[codes.long()] * torch.pow(2.0, ex.clamp(-126, 127).double()).float()
    assert torch.equal(out.cpu().view(torch.int32), ref.view(torch.int32))
