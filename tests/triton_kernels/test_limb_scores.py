"""The INT8 tensor-core score prototype (``triton_kernels/limb_scores.py``, issue 17) in Triton's interpreter: for every
full block, query head and token its scores stay within ``limb_score_rounding`` (four limbs) of the real-number INT8
score evaluated in float64 from the page's own codes, offsets and scales; the float32 twin within the float32 path's
R_b; both log-masses are the logsumexp of their scores; blocks past a row's last full block stay −inf."""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from certvllm.bounds import rounding_factor  # noqa: E402
from certvllm.bounds.int8_scores import limb_score_rounding, split_query_limbs  # noqa: E402
from certvllm.formats.keys import key_sigma  # noqa: E402
from certvllm.formats.layout import PageLayout, key_scale_lut  # noqa: E402
from certvllm.formats.pages import _field  # noqa: E402
from certvllm.testing import make_case, paged_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted here


@pytest.mark.parametrize(("hq", "hkv", "d", "family"), [(8, 2, 64, "retrieval_peaks"), (14, 2, 64, "random"),
                                                        (4, 2, 128, "sink_and_recency")])  # fmt: skip
def test_limb_scores_stay_within_their_rounding_term(hq, hkv, d, family):
    from certvllm.triton_kernels.limb_scores import LIMBS, block_scores

    gen = torch.Generator().manual_seed(hq * d)
    cases = [make_case(family, t, hq, hkv, d, torch.bfloat16, gen) for t in (70, 45)]  # 4 and 2 full blocks
    cache, tables, lens = paged_batch(cases)
    layout: PageLayout = cache.layout
    q = (torch.stack([c.q for c in cases]).float() * torch.tensor(1 / math.sqrt(d), dtype=torch.float32)).float()
    nfull = lens // 16
    pages = cache.pages
    args = [t.to(DEVICE) for t in (q, pages)] + [layout] + [t.to(DEVICE) for t in (tables, nfull)]
    got, lmass = (t.cpu() for t in block_scores(*args, mma=True, splits=2))
    twin, lmass_twin = (t.cpu() for t in block_scores(*args, mma=False))
    g = hq // hkv
    for r in range(len(cases)):
        for b in range(tables.shape[1]):
            if b >= int(nfull[r]):
                assert bool(torch.isinf(lmass[r, :, :, b]).all()) and bool((lmass[r, :, :, b] < 0).all())
                continue
            page = pages[int(tables[r, b])]  # [H_kv, page_bytes]
            codes = _field(page, layout.k_codes, 16 * d, torch.uint8).unflatten(-1, (16, d))  # [H_kv, N, D]
            offsets = _field(page, layout.k_offset, 2 * d, torch.float16).float()  # [H_kv, D]
            exponent = page[:, layout.header + 8].view(torch.int8)
            sigma = key_sigma(_field(page, layout.k_scale_code, d, torch.uint8), exponent, key_scale_lut())
            for h in range(hkv):
                qh = q[r, h * g : (h + 1) * g]  # [G, D]
                exact = (qh.double()[:, None, :] * (offsets[h].double() + codes[h].double() * sigma[h].double())
                         ).sum(-1)  # [G, N]  # fmt: skip
                split = split_query_limbs(qh * sigma[h], LIMBS)
                bound = limb_score_rounding(qh, offsets[h].expand(g, d), sigma[h].expand(g, d), split)  # [G]
                # the bound less 2^-30 of itself: far more than the float64 reference's own error
                ratio = (got[r, h, b].double() - exact).abs() / bound.double()[:, None]
                assert bool((ratio <= 1 - 2.0**-30).all()), float(ratio.max())
                mag = (qh.abs() * (offsets[h].abs() + 256 * sigma[h])).sum(-1)  # the float32 path's R_b, loosely
                twin_err = (twin[r, h, b].double() - exact).abs()
                assert bool((twin_err <= rounding_factor(d) * mag.double()[:, None]).all())
                for scores, lm in ((got, lmass), (twin, lmass_twin)):
                    assert torch.allclose(lm[r, h, :, b].double(), torch.logsumexp(scores[r, h, b].double(), -1),
                                          rtol=1e-6, atol=1e-6)  # fmt: skip
