"""Input families for soundness checks, and the float64 exact reference.

Shared by the test-suite, ``benchmarks/bench_soundness.py`` and the GPU tests, so every check
runs over the same random and adversarial distributions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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


def paged_batch(cases: list[Case], value_group: int = 16):
    """Write several sequences into one tiered cache through the serving write path.

    Blocks are handed out in a shuffled order with block 0 left unused, as vLLM does.
    Returns ``(cache, block_tables [S, max_blocks], seq_lens [S])``.
    """
    from certvllm.formats.layout import BLOCK_SIZE
    from certvllm.kv.cache import LayerKVCache

    lens = [c.k.shape[0] for c in cases]
    nbs = [-(-t // BLOCK_SIZE) for t in lens]
    total = sum(nbs)
    _, hkv, d = cases[0].k.shape
    cache = LayerKVCache.allocate(total + 1, hkv, d, cases[0].k.dtype, value_group=value_group)
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
    cache, tables, lens = paged_batch(cases, config.value_group_size)
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


def capture_attend_args(call) -> tuple:
    """Run ``call()`` (a CUDA certified call) and return copies of the arguments of its first attend pass
    (``triton_kernels.phase2.attend``: geometry, scores, m, shadow, pages, tables, nfull, bits, active,
    exact_lm), for replaying the pass alone in other kernel configurations."""
    import certvllm.attention.gpu as gpu_mod

    seen: list[tuple] = []
    orig = gpu_mod.attend

    def spy(*args):
        if not seen:  # copies of everything but the pinned host shadow (gigabytes at long contexts)
            seen.append(tuple(a.clone() if isinstance(a, torch.Tensor) and not a.is_pinned() else a for a in args))
        return orig(*args)

    gpu_mod.attend = spy
    try:
        call()
    finally:
        gpu_mod.attend = orig
    if not seen:
        raise RuntimeError("the call ran no attend pass (every group escalated before phase 2?)")
    return seen[0]


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
