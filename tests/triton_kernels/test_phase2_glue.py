"""The phase-2 glue kernels (``triton_kernels/phase2_glue.py``) against the torch expressions they replace.

Both compute integers, booleans or maxima, so the comparison is exact (``torch.equal``; NaN where torch has
NaN). In Triton's interpreter here, compiled on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from certvllm.triton_kernels.phase2_glue import global_max, rerun_inputs  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("splits", [1, 5, 64])
def test_global_max_is_torch_maximum_of_amaxes(splits: int) -> None:
    g = torch.Generator().manual_seed(splits)
    smax = torch.randn(3, 2, 4, splits, generator=g)
    s_tail = torch.randn(3, 2, 4, 16, generator=g)
    smax[0, 0, 0] = float("-inf")  # a head with nothing promoted
    s_tail[0, 0, 0, 3:] = float("-inf")  # a partial block of 3 live tokens
    s_tail[1, 1, 2] = float("-inf")  # no partial block, nothing promoted in one split
    smax[2, 1, 3, -1] = float("nan")  # NaN is kept, as torch's amax keeps it
    want = torch.maximum(smax.amax(dim=-1), s_tail.amax(dim=-1))
    got = global_max(smax.to(DEV), s_tail.to(DEV)).cpu()
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 1
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("group,width", [(4, 37), (7, 1100), (16, 5)])
def test_rerun_inputs_are_the_torch_lines(group: int, width: int) -> None:
    R, K = 3, 2
    g = torch.Generator().manual_seed(group)
    exact = torch.rand(R, K * group, generator=g) < 0.2
    exact[0] = False  # a row with nothing escalated
    exact[1, :group] = True
    # the report's rungs: 3 or 4 where escalated, 0–2 elsewhere
    high, low = torch.randint(3, 5, exact.shape, generator=g), torch.randint(0, 3, exact.shape, generator=g)
    rung = torch.where(exact, high, low)
    nfull = torch.tensor([width, width - 3, 0])
    bits, active, canary, kslot = rerun_inputs(rung.to(torch.int8).to(DEV), nfull.to(DEV), K, width)
    assert kslot is None  # no write-through pool: no slot map
    want_active = exact.view(R, K, group).any(dim=-1)
    bvalid = torch.arange(width) < nfull.unsqueeze(1)
    full = (1 << (2 * group)) - 1
    want_bits = torch.where(want_active[:, :, None] & bvalid[:, None, :], full, 0).to(torch.int32)
    assert torch.equal(active.cpu(), want_active.to(torch.int32))
    assert torch.equal(bits.cpu(), want_bits)
    assert torch.equal(canary.cpu(), torch.zeros(R, dtype=torch.int32))
