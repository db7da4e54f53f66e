"""Input families for soundness checks, the float64 exact reference, the float64 evaluation of a certified
call (``certified_exact``, ``run_with_exact``) and FlashAttention's tolerance rule for cross-implementation
agreement (``assert_within_lowp_error``).

Shared by the test-suite, ``benchmarks/bench_soundness.py`` and the GPU tests, so every check
runs over the same random and adversarial distributions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from certvllm.formats.layout import CODE_LEVELS

FAMILIES = (
    "random",
    "outlier_channels",
    "near_tied_blocks",
    "one_hot",
    "flat",
    "constant_channels",
    "tiny_norms",
    "huge_norms",
    "sink_and_recency",
    "retrieval_peaks",
)


@dataclass
class Case:
    """One decode step: ``q`` ``[H_q, D]``, ``k``/``v`` ``[T, H_kv, D]`` in ``dtype``."""

    family: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Exact attention in float64 over the given originals: ``[H_q, D]`` float64."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    hkv = k.shape[1]
    qg = q.double().view(hkv, q.shape[0] // hkv, d)  # query heads grouped by their KV head
    scores = torch.einsum("kgd,tkd->kgt", qg, k.double()) * scale
    return torch.einsum("kgt,tkd->kgd", torch.softmax(scores, dim=-1), v.double()).reshape(q.shape[0], d)


def make_case(family: str, t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> Case:
    """Draw one case of ``family`` (see :data:`FAMILIES`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    q = randn(hq, d) * (0.5 + 2.5 * rand(1).item())
    k = randn(t, hkv, d)
    v = randn(t, hkv, d)
    if family == "outlier_channels":
        chans = torch.randperm(d, generator=gen)[: max(1, d // 16)]
        k[:, :, chans] *= 100.0
        q[:, chans] *= 0.05
    elif family == "near_tied_blocks":
        # every block a copy of one block plus tiny noise: masses tie, INT8 noise reorders them
        base = randn(16, hkv, d)
        nb = -(-t // 16)
        k = (base.repeat(nb, 1, 1)[:t] + 1e-3 * randn(t, hkv, d)) * 2.0
        q = q * 2.0
    elif family == "one_hot":
        target = int(torch.randint(0, t, (1,), generator=gen))
        for h in range(hq):
            q[h] = k[target, h * hkv // hq] * 4.0
    elif family == "flat":
        q = q * 1e-3
    elif family == "constant_channels":
        chans = torch.randperm(d, generator=gen)[: d // 4]
        k[:, :, chans] = randn(1, hkv, len(chans))
        v[:, :, chans] = 0.5
    elif family == "tiny_norms":
        k, v = k * 1e-3, v * 1e-3
    elif family == "huge_norms":
        k, v = k * 300.0, v * 300.0
        q = q * 0.05
    elif family == "sink_and_recency":
        k[0] *= 6.0
        recent = torch.linspace(0.0, 3.0, t, dtype=torch.float64).view(t, 1, 1)
        k = k + recent * k.mean(dim=0, keepdim=True)
    elif family == "retrieval_peaks":
        for _ in range(3):
            pos = int(torch.randint(0, t, (1,), generator=gen))
            k[pos] = q.view(hkv, hq // hkv, d).mean(dim=1) * 3.0
    return Case(family, q.to(dtype), k.to(dtype), v.to(dtype))


def exact_int8_scores(q_scaled: torch.Tensor, cache, block_ids: torch.Tensor) -> torch.Tensor:
    """The real-number INT8 scores ŝ_t = Σ_c q'_c(ℓ̃_c + code_{t,c}·σ_c) of one row, in float64, from its decoded pages:
    ``q_scaled`` q' = fl(q·λ) ``[H_q, D]``, ``block_ids`` ``[n]`` (16-token blocks of ``cache``) →
    ``[H_kv, n, G, 16]`` (what phase 1's scores must be within R_b of)."""
    from certvllm.formats.pages import PageReader

    lay = cache.layout
    d = lay.head_dim
    pages = cache.pages[block_ids.to(cache.pages.device)]  # [n, H_kv, page bytes] (one 16-token block per page)
    sigma = PageReader(lay).decode(pages, with_values=False).sigma.double()
    codes = pages[:, :, lay.k_codes : lay.k_codes + 16 * d].reshape(*pages.shape[:2], 16, d)
    off = pages[:, :, lay.k_offset : lay.k_offset + 2 * d].contiguous().view(torch.float16).double()
    k_hat = off[:, :, None, :] + codes.double() * sigma[:, :, None, :]  # [n, H_kv, 16, D]
    q = q_scaled.to(k_hat.device).double()
    return torch.einsum("kgd,bknd->kbgn", q.view(pages.shape[1], -1, d), k_hat)


def out_of_phase1_range_case(gen: torch.Generator) -> list[Case]:
    """One bfloat16 row (70 tokens, 4 query heads, 1 KV head, D = 64) whose head 1 is 2^-100 times smaller, on keys
    2^-20 times smaller: its grid exponent is below the range of phase 1's INT8-MMA scores (``bounds.int8_scores``),
    so that head's R_b is +inf and it must escalate (the others stay in range)."""
    case = make_case("random", 70, 4, 1, 64, torch.bfloat16, gen)
    case.q[1] *= 2.0**-100
    case.k.mul_(2.0**-20)
    return [case]


@dataclass
class SoundnessResult:
    """Outcome of checking a batch of cases (one row per case; tensors ``[rows, H_q]``).

    Attributes:
        error: ‖out − exact‖₂ per head (float64).
        bound: e_key + e_val per head.
        rung: rung per head.
        violations: heads with rung ≤ 2 and error > bound.
        dense_mismatch: heads with rung ≥ 3 whose output is not bit-identical to ``dense_decode``.
    """

    error: torch.Tensor
    bound: torch.Tensor
    rung: torch.Tensor
    violations: int
    dense_mismatch: int
    report: object


def paged_batch(cases: list[Case], value_group: int = 16, code_levels: tuple[int, int] = CODE_LEVELS):
    """Write several sequences into one tiered cache through the serving write path (``code_levels``: the
    largest key and value codes of the page format, fewer for the stress study's formats).

    Blocks are handed out in a shuffled order with block 0 left unused, as vLLM does.
    Returns ``(cache, block_tables [S, max_blocks], seq_lens [S])``.
    """
    from certvllm.formats.layout import BLOCK_SIZE
    from certvllm.kv.cache import LayerKVCache

    lens = [c.k.shape[0] for c in cases]
    nbs = [-(-t // BLOCK_SIZE) for t in lens]
    total = sum(nbs)
    _, hkv, d = cases[0].k.shape
    cache = LayerKVCache.allocate(total + 1, hkv, d, cases[0].k.dtype, value_group=value_group, code_levels=code_levels)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(total)) + 1
    tables = torch.zeros(len(cases), max(nbs), dtype=torch.int64)
    slots = []
    start = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = perm[start : start + nb]
        start += nb
        pos = torch.arange(lens[i])
        slots.append(tables[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    cache.write(torch.cat([c.k for c in cases]), torch.cat([c.v for c in cases]), torch.cat(slots))
    return cache, tables, torch.tensor(lens)


def check_soundness(cases: list[Case], config, scale: float | None = None, backend: str = "auto") -> SoundnessResult:
    """Run one batched certified call over ``cases`` (same head counts, D and dtype) with the op's
    ``backend`` and compare every head with the float64 exact reference and with the dense path."""
    from certvllm.attention import certified_attention, dense_decode

    d = cases[0].q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    cache, tables, lens = paged_batch(cases, config.value_group_size, config.code_levels)
    q = torch.stack([c.q for c in cases])
    res = certified_attention(q, cache, tables, lens, config, scale, backend=backend)
    errors, mismatch = [], 0
    for i, c in enumerate(cases):
        ref = exact_attention(c.q, c.k, c.v, scale)
        errors.append(torch.linalg.vector_norm(res.out[i].double() - ref, dim=-1))
        exact_heads = res.report.rung[i] >= 3
        if bool(exact_heads.any()):
            dense = dense_decode(c.q, c.k, c.v, scale)
            mismatch += int((dense[exact_heads] != res.out[i][exact_heads]).any(dim=-1).sum())
    error = torch.stack(errors)
    bound = res.report.bound.double()
    certified = res.report.rung <= 2
    violations = int((certified & ~(error <= bound)).sum())
    return SoundnessResult(error, bound, res.report.rung, violations, mismatch, res.report)


def capture_pass_args(name: str, call) -> tuple:
    """Run ``call()`` (a CUDA certified call) and return copies of the arguments of its first call of the phase-2
    launcher ``name`` (``"attend"`` or ``"promote"`` of ``triton_kernels.phase2``, as ``attention.gpu`` calls
    them), for replaying that pass alone in other kernel configurations. The pinned host shadow (gigabytes at
    long contexts) is passed through, not copied."""
    import certvllm.attention.gpu as gpu_mod

    seen: list[tuple] = []
    orig = getattr(gpu_mod, name)

    def spy(*args, **kwargs):  # the first positional call: the main pass (the re-run passes exact_rerun=)
        if not seen:
            seen.append(tuple(a.clone() if isinstance(a, torch.Tensor) and not a.is_pinned() else a for a in args))
        return orig(*args, **kwargs)

    setattr(gpu_mod, name, spy)
    try:
        call()
    finally:
        setattr(gpu_mod, name, orig)
    if not seen:
        raise RuntimeError(f"the call ran no {name} pass (every group escalated before phase 2?)")
    return seen[0]


def capture_attend_args(call) -> tuple:
    """:func:`capture_pass_args` of the attend pass: (geometry, scores, m, shadow, pages, tables, nfull, bits,
    active, exact_lm)."""
    return capture_pass_args("attend", call)


def attend_deviation(out, lm: torch.Tensor, ref, ref_lm: torch.Tensor, vabs_max: float) -> dict:
    """How far one attend pass (``phase2.AttendOut`` ``out`` and its exact_lm ``lm``) is from another
    (``ref``, ``ref_lm``) computed from the same inputs with a different summation order, each deviation
    divided by what float32 rounding allows (so ≤ 1 is agreement):

    * ``acc``: each kernel's output sums are within γ_16·Σ_t w_t|v_t| ≤ γ_16·den·max|v| of the exact
      ones (float32 sums over at most 16 tokens, float64 after), so two kernels within 2γ_16·den·vabs_max;
    * ``den``/``aval``/``atail``: per-block 16-term float32 sums in another order, relative 1e-5;
    * ``lm`` (m + log den_b where written): 1e-5 + 2^-22·|lm|, and written at the same places.

    ``vabs_max`` must bound |v̂| and |v| over the inputs. Returns the ratios and ``ok``."""
    den = ref.den.sum(dim=2)
    gamma16 = 16 * 2.0**-24 / (1 - 16 * 2.0**-24)
    allow = 2 * gamma16 * den.unsqueeze(-1) * vabs_max + 1e-300
    dev = {"acc": float(((out.acc.sum(dim=2) - ref.acc.sum(dim=2)).abs() / allow).max())}
    for name in ("den", "aval", "atail"):
        a, b = getattr(out, name).sum(dim=2), getattr(ref, name).sum(dim=2)
        dev[name] = float(((a - b).abs() / (1e-5 * b.abs()).clamp_min(1e-300)).max())
    fin = torch.isfinite(ref_lm)
    same_places = bool(torch.equal(fin, torch.isfinite(lm)))
    dev["lm"] = float(((lm - ref_lm).abs() / (1e-5 + 2.0**-22 * ref_lm.abs()))[fin].max()) if bool(fin.any()) else 0.0
    dev["ok"] = same_places and max(v for k, v in dev.items() if k != "ok") <= 1.0
    return dev


def assert_within_lowp_error(
    out: torch.Tensor,
    ref64: torch.Tensor,
    ref_lowp: torch.Tensor,
    factor: float = 2.0,
    atol: float = 0.0,
    dim: int | tuple[int, ...] | None = None,
    what: str = "output",
) -> None:
    """Assert that ``out`` is at most ``factor`` times as far from the float64 answer as a plain
    same-precision implementation of the same computation is (the rule of FlashAttention's tests):

        max |out − ref64| ≤ factor · max |ref_lowp − ref64| + atol

    ``ref64`` is the computation in float64, ``ref_lowp`` the same computation done the obvious way in the
    precision ``out`` claims (float32 math, float16 outputs, …). The tolerance is then the arithmetic's own
    rounding at these inputs, not a hand-picked constant: it shrinks with tiny values and grows with long
    sums, and an implementation that drops precision somewhere (a bf16 product, a lost float64 sum, a
    wrong operand) is caught even when its error would pass a fixed ``rtol``.

    The maxima are taken over ``dim`` (every element by default; ``dim=-1`` checks each vector along the
    last axis on its own, for batches whose slices differ in scale) — not element by element: two
    implementations' rounding errors are uncorrelated element by element, so on any one element the
    low-precision reference may happen to be exact while a correct implementation rounds the other way.
    ``atol`` is the floor for that case at the level of a whole slice: where the low-precision reference
    happens to be exact on every element (an exactly one-hot softmax, constant value rows, short exact
    sums), any other order of the same operations would fail a zero tolerance. Keep it to a few ulps of
    the output's scale.

    Raises ``AssertionError`` naming the worst element (index, the three values), both errors, the
    allowance and the factor.
    """
    if not (out.shape == ref64.shape == ref_lowp.shape):
        raise AssertionError(f"{what}: shapes differ: out {list(out.shape)}, ref64 {list(ref64.shape)}, "
                             f"ref_lowp {list(ref_lowp.shape)}")  # fmt: skip
    if ref64.dtype != torch.float64:
        raise AssertionError(f"{what}: ref64 must be float64, got {ref64.dtype}")
    o, r, lo = out.double(), ref64, ref_lowp.double()
    bad = torch.isfinite(r) & ~torch.isfinite(o)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: non-finite out at {idx}: out={float(o[idx])!r}, ref64={float(r[idx])!r}")
    err = torch.nan_to_num((o - r).abs(), nan=0.0)
    err_lowp = torch.nan_to_num((lo - r).abs(), nan=0.0)
    if out.numel() == 0:
        return
    dims = tuple(range(out.dim())) if dim is None else ((dim,) if isinstance(dim, int) else tuple(dim))
    worst = err.amax(dim=dims, keepdim=True)
    worst_lowp = err_lowp.amax(dim=dims, keepdim=True)
    allowed = factor * worst_lowp + atol
    excess = worst - allowed
    if bool((excess <= 0).all()):
        return
    # the worst element: the largest error inside the slice that exceeds its allowance by the most
    slice_excess = excess.expand_as(err)
    score = torch.where(slice_excess == slice_excess.max(), err, -1.0)
    idx = tuple(int(i) for i in (score == score.max()).nonzero()[0])
    n_bad = int((excess > 0).sum())
    n_slices = excess.numel()
    raise AssertionError(
        f"{what}: |out − ref64| = {float(err[idx]):.6g} at {idx} (out={float(o[idx])!r}, ref64={float(r[idx])!r}, "
        f"ref_lowp={float(lo[idx])!r}) > factor·max|ref_lowp − ref64| + atol = {factor:g}·"
        f"{float(worst_lowp.expand_as(err)[idx]):.6g} + {atol:.3g} = {float(allowed.expand_as(err)[idx]):.6g} "
        f"(ratio {float(err[idx]) / max(float(worst_lowp.expand_as(err)[idx]), 1e-300):.3g} to the same-precision "
        f"error; {n_bad} of {n_slices} slice(s) over, max over dims {dims})"
    )


def _dequantized64(cache, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k̂ = ℓ̃ + code·σ and v̂ = zero + code·scale of whole blocks in float64 (the products of 8-bit codes with
    float32 σ and float16 scales are exact in a double, the sum rounds once at 2^-53): ``[n, H_kv, N, D]``."""
    from certvllm.formats.keys import key_sigma
    from certvllm.formats.layout import key_scale_lut
    from certvllm.formats.values import unpack_int4

    lay = cache.layout
    n, d, g = lay.block_size, lay.head_dim, lay.groups
    pages = cache.read_pages(block_ids).cpu()  # [n, H_kv, page_bytes]

    def field(start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return pages[..., start : start + nbytes].contiguous().view(dtype)

    exponent = pages[..., lay.header + 8].contiguous().view(torch.int8)
    sigma = key_sigma(field(lay.k_scale_code, d, torch.uint8), exponent, key_scale_lut()).double()
    offset = field(lay.k_offset, 2 * d, torch.float16).double()
    kcodes = field(lay.k_codes, n * d, torch.uint8).unflatten(-1, (n, d)).double()
    keys = offset.unsqueeze(-2) + kcodes * sigma.unsqueeze(-2)
    vcodes = unpack_int4(field(lay.v_codes, n * d // 2, torch.uint8).unflatten(-1, (n, d // 2))).double()
    vscale = field(lay.v_scale, 2 * n * g, torch.float16).unflatten(-1, (n, g)).double()
    vzero = field(lay.v_zero, 2 * n * g, torch.float16).unflatten(-1, (n, g)).double()
    values = (vzero.unsqueeze(-1) + vcodes.unflatten(-1, (g, -1)) * vscale.unsqueeze(-1)).flatten(-2)
    return keys, values


def certified_exact(
    q: torch.Tensor,
    cache,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor,
    value_mask: torch.Tensor,
) -> torch.Tensor:
    """The certified computation of a call, in float64: ``[R, H_q, D]``.

    For the selection ``key_mask``/``value_mask`` ``[R, H_kv, G, B]`` (block b of row r read with original
    keys / values for query head g), one softmax over every token in float64: original keys and values of
    promoted full blocks, k̂/v̂ (exact float64 dequantization) of the others, originals for the trailing
    partial block. A head whose masks are all set is exact attention over the originals (rungs 3/4)."""
    lay = cache.layout
    N = lay.block_size
    R, Hq, D = q.shape
    K = cache.num_kv_heads
    G = Hq // K
    tables, lens = block_tables.cpu().long(), seq_lens.cpu().long()
    key_mask, value_mask = key_mask.cpu(), value_mask.cpu()
    outs = []
    for r in range(R):
        t = int(lens[r])
        nf, nt = t // N, t % N
        qd = q[r].cpu().double().view(K, G, D) * scale
        orig = cache.shadow_blocks(tables[r, : -(-t // N)]).double()  # [nb, K, 2, N, D]
        ok, ov = orig[:, :, 0].transpose(0, 1), orig[:, :, 1].transpose(0, 1)  # [K, nb, N, D]
        scores, nums = [], []
        if nf:
            kh, vh = (x.transpose(0, 1) for x in _dequantized64(cache, tables[r, :nf]))  # [K, nf, N, D]
            km, vm = key_mask[r, :, :, :nf, None], value_mask[r, :, :, :nf, None]  # [K, G, nf, 1]
            s_full = torch.where(km, torch.einsum("kgd,kbnd->kgbn", qd, ok[:, :nf]),
                                 torch.einsum("kgd,kbnd->kgbn", qd, kh))  # fmt: skip
            scores.append(s_full.flatten(-2))
        if nt:
            scores.append(torch.einsum("kgd,knd->kgn", qd, ok[:, nf, :nt]))
        w = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        if nf:
            wf = w[..., : nf * N].unflatten(-1, (nf, N))
            nums.append(torch.where(vm, torch.einsum("kgbn,kbnd->kgbd", wf, ov[:, :nf]),
                                    torch.einsum("kgbn,kbnd->kgbd", wf, vh)).sum(dim=2))  # fmt: skip
        if nt:
            nums.append(torch.einsum("kgn,knd->kgd", w[..., nf * N :], ov[:, nf, :nt]))
        outs.append(sum(nums).reshape(Hq, D))
    return torch.stack(outs)


def run_with_exact(call, q: torch.Tensor, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float):
    """Run ``call()`` (a certified call over these rows, on the reference or the CUDA path) and return its
    result with the float64 evaluation of what it computed (:func:`certified_exact` over the selection the
    call made, every block of its rung-3/4 heads original): ``(CertifiedOutput, [R, H_q, D] float64)``.

    The selection is read where the path makes it: ``select_values`` in ``reference.py`` (its key mask
    argument and its value mask result, per chunk of rows) and ``gpu._select`` (the promotion bitmask).
    The resident pass (``resident._read_exactly``) reports what it read unquantized: resident pool pages and
    the top-up's promotions. A call in a mode without selection (naive) promotes nothing. The compiled CPU
    kernel keeps its selection inside (a call that promoted blocks the spies did not see raises): use the reference's
    (``backend="reference"``), on the heads where the two agree."""
    import certvllm.attention.reference as ref_mod

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    orig_values = ref_mod.select_values

    def spy_values(ph1, key_mask, cfg):
        value_mask = orig_values(ph1, key_mask, cfg)
        seen.append((key_mask.cpu().clone(), value_mask.cpu().clone()))
        return value_mask

    def spy_select(call_, *args):
        bits, widened = orig_select(call_, *args)  # orig_select: bound below, before any call
        G = call_.shape[2]
        shifts = torch.arange(G, dtype=torch.int32).view(1, 1, G, 1)
        b = bits.cpu().unsqueeze(2)
        seen.append((((b >> shifts) & 1).bool(), ((b >> (shifts + G)) & 1).bool()))
        return bits, widened

    def spy_read(first, second, need):
        bits = orig_read(first, second, need)
        G = q.shape[1] // cache.num_kv_heads
        shifts = torch.arange(G, dtype=torch.int32).view(1, 1, G, 1)
        b = bits.cpu().unsqueeze(2)
        seen.append((((b >> shifts) & 1).bool(), ((b >> (shifts + G)) & 1).bool()))
        return bits

    patches = [(ref_mod, "select_values", orig_values, spy_values)]
    try:
        import certvllm.attention.gpu as gpu_mod
        import certvllm.attention.resident as resident_mod

        orig_select = gpu_mod._select
        orig_read = resident_mod._read_exactly
        patches.append((gpu_mod, "_select", orig_select, spy_select))
        patches.append((resident_mod, "_read_exactly", orig_read, spy_read))
    except ImportError:  # no Triton: only the reference path can run
        pass
    for module, name, _, spy in patches:
        setattr(module, name, spy)
    try:
        res = call()
    finally:
        for module, name, orig, _ in patches:
            setattr(module, name, orig)
    R, Hq, _ = q.shape
    K = cache.num_kv_heads
    B = block_tables.shape[1]
    key_mask = torch.zeros(R, K, Hq // K, B, dtype=torch.bool)
    value_mask = torch.zeros_like(key_mask)
    row = 0
    for km, vm in seen:
        n, b = km.shape[0], km.shape[-1]
        key_mask[row : row + n, ..., :b], value_mask[row : row + n, ..., :b] = km, vm
        row += n
    promoted = bool((res.report.k_star > 0).any() or (res.report.v_promoted > 0).any())
    if (seen and row != R) or (promoted and not seen):
        raise RuntimeError(f"the spies saw the selections of {row} rows of {R} (the compiled CPU kernel's are unseen)")
    exact = (res.report.rung.cpu() >= 3).view(R, K, Hq // K, 1)
    key_mask, value_mask = key_mask | exact, value_mask | exact
    return res, certified_exact(q, cache, block_tables, seq_lens, scale, key_mask, value_mask)


# ---- fault injection (tests only: nothing in the serving code reads or calls any of this) ---------------------
PAGE_FIELDS = {
    # name: (layout attribute of the field's start, bytes as a function of (N, D, G), element dtype)
    "key_codes": ("k_codes", lambda n, d, g: n * d, torch.uint8),
    "value_codes": ("v_codes", lambda n, d, g: n * d // 2, torch.uint8),
    "value_scales": ("v_scale", lambda n, d, g: 2 * n * g, torch.int16),
    "value_zeros": ("v_zero", lambda n, d, g: 2 * n * g, torch.int16),
    "key_offsets": ("k_offset", lambda n, d, g: 2 * d, torch.int16),
    "key_scales": ("k_scale_code", lambda n, d, g: d, torch.uint8),
    "eta": ("header", lambda n, d, g: 4, torch.int32),
    "nu": (None, lambda n, d, g: 4, torch.int32),  # header + 4
    "exponent": (None, lambda n, d, g: 1, torch.uint8),  # header + 8
    "flags": (None, lambda n, d, g: 1, torch.uint8),  # header + 9
    "reserved": (None, lambda n, d, g: 6, torch.uint8),  # header + 10
}
"""The fields of a tier-1 page (``certvllm.formats.layout``) that :func:`flip_page_bits` can corrupt, with the
integer view their bits are flipped in (one element per fp16 scale/zero/offset, per fp32 annotation)."""
_HEADER_OFFSETS = {"eta": 0, "nu": 4, "exponent": 8, "flags": 9, "reserved": 10}


def page_field(layout, field: str) -> tuple[int, int, torch.dtype]:
    """``(start byte, bytes, element dtype)`` of ``field`` (:data:`PAGE_FIELDS`) inside one page of ``layout``."""
    if field not in PAGE_FIELDS:
        raise ValueError(f"unknown page field {field!r}; choose one of {', '.join(PAGE_FIELDS)}")
    attr, size, dtype = PAGE_FIELDS[field]
    start = layout.header + _HEADER_OFFSETS[field] if field in _HEADER_OFFSETS else getattr(layout, attr)
    return start, size(layout.block_size, layout.head_dim, layout.groups), dtype


def page_bytes_view(cache, block: int, head: int) -> torch.Tensor:
    """The ``[page_bytes]`` uint8 page of 16-token block ``block`` and KV head ``head``, as a *view* of the cache's
    tier-1 tensor: writing it changes the page in place, without the write generation a real writer bumps (a
    silent corruption, as a bad kernel or a bit flip in device memory would make)."""
    m, page = cache.sub_blocks, cache.layout.page_bytes
    return cache.pages[block // m, head, (block % m) * page : (block % m + 1) * page]


def flip_page_bits(cache, blocks, heads, field: str, mask: int, elements: slice | None = None) -> int:
    """XOR ``mask`` into every element (or ``elements``) of ``field`` in the pages of each block of ``blocks`` and
    each KV head of ``heads``, in place (:func:`page_bytes_view`). ``mask`` applies to the field's element type
    (uint8 codes, the int16 bits of an fp16 scale, zero or offset, the int32 bits of an fp32 η/ν). Returns the
    number of elements changed."""
    start, nbytes, dtype = page_field(cache.layout, field)
    changed = 0
    for b in [int(x) for x in torch.as_tensor(blocks).reshape(-1).tolist()]:
        for h in [int(x) for x in torch.as_tensor(heads).reshape(-1).tolist()]:
            region = page_bytes_view(cache, b, h)[start : start + nbytes].view(dtype)
            target = region if elements is None else region[elements]
            target.bitwise_xor_(torch.tensor(mask, dtype=torch.int64).to(dtype))
            changed += target.numel()
    return changed


def flip_random_bit(cache, block: int, head: int, gen: torch.Generator, field: str | None = None) -> tuple:
    """Flip one random bit of one page (in ``field``, or anywhere in the page's used bytes); returns
    ``(field, byte offset in the page, bit)``."""
    fields = [field] if field is not None else list(PAGE_FIELDS)
    sizes = [page_field(cache.layout, name)[1] for name in fields]
    at = int(torch.randint(0, sum(sizes), (1,), generator=gen))
    chosen = fields[-1]
    for name, size in zip(fields, sizes, strict=True):
        if at < size:
            chosen = name
            break
        at -= size
    f = chosen
    start = page_field(cache.layout, f)[0]
    bit = int(torch.randint(0, 8, (1,), generator=gen))
    page = page_bytes_view(cache, block, head)
    page[start + at] ^= 1 << bit
    return f, start + at, bit


def flip_pool_bits(pool, slots, mask: int, values: bool = False) -> None:
    """XOR ``mask`` into the 16-bit elements of promotion-pool slots ``slots`` (their unquantized key pages, or
    value pages with ``values``), in place and without touching the tags: the pool then serves wrong originals as
    if they were the shadow's (``certvllm.kv.promotion_cache``; CUDA only)."""
    data = pool.values if values else pool.pool
    if data is None:
        raise ValueError("this pool holds no value pages")
    idx = torch.as_tensor(slots, device=data.device).reshape(-1)
    bits = data[idx].view(torch.int16) ^ torch.tensor(mask, dtype=torch.int16, device=data.device)
    data[idx] = bits.view(data.dtype)


def faulty_pagein(device: torch.device | str = "cpu", mode: str = "raise", after: int = 0, times: int | None = None,
                  bit: int = 14):  # fmt: skip
    """A host page-in engine (``certvllm.kv.pagein.PageInEngine``) that fails on purpose.

    Args:
        mode: ``"raise"``: a gather's copy fails as the CPU allocator fails when host memory is exhausted (a
            ``RuntimeError`` "DefaultCPUAllocator: can't allocate memory"), which the engine reports as a
            ``PageInError``; ``"corrupt"``: a gather "succeeds" but returns its pages with bit ``bit`` of every
            16-bit element flipped.
        after: gathers that succeed before the fault starts; times: how many gathers fail (None: every later one).

    The engine counts ``gathers`` (asked for) and ``faults`` (failed or corrupted).
    """
    from certvllm.kv.pagein import PageInEngine

    if mode not in ("raise", "corrupt"):
        raise ValueError(f"mode={mode!r}: 'raise' or 'corrupt'")

    class FaultyPageIn(PageInEngine):
        def __init__(self) -> None:
            super().__init__(device)
            self.mode, self.after, self.times, self.bit = mode, after, times, bit
            self.gathers = 0
            self.faults = 0

        def _fault_now(self) -> bool:
            self.gathers += 1
            if self.gathers <= self.after or (self.times is not None and self.faults >= self.times):
                return False
            self.faults += 1
            return True

        def _read(self, read):
            if not self._fault_now():
                return super()._read(read)
            if self.mode == "raise":

                def exhausted() -> torch.Tensor:
                    raise RuntimeError(
                        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                        "you tried to allocate 1048576 bytes. Error code 12 (Cannot allocate memory) [injected]"
                    )

                return super()._read(exhausted)
            out = super()._read(read).contiguous()
            flipped = out.view(torch.int16) ^ torch.tensor(1 << self.bit, dtype=torch.int16, device=out.device)
            return flipped.view(out.dtype)

    return FaultyPageIn()


def metric_samples(registry, drop: tuple[str, ...] = ("model_name", "engine")) -> dict[str, float]:
    """Every sample of a ``prometheus_client`` registry but creation times, keyed ``name{label=value,...}`` with the
    labels sorted and those in ``drop`` left out (so that two metrics instances compare)."""
    out = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in drop)
            out[f"{s.name}{{{labels}}}"] = s.value
    return out
