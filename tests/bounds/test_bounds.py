"""The bound terms against brute force: random and worst-case score perturbations."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from certvllm.bounds import exp_rounding, gamma, key_sum_bound, tail_mass_upper
from certvllm.bounds.rounding import UNIT_ROUNDOFF


def _perturbed(seed: int, n: int, tail_frac: float, delta: float, rounding: float, temp: float):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, generator=g, dtype=torch.float64) * temp
    tail = torch.rand(n, generator=g, dtype=torch.float64) < tail_frac
    # worst-case style perturbations: ±(Δ + R) on the tail, ±R elsewhere
    sign = torch.where(torch.rand(n, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    eps = sign * torch.where(tail, delta + rounding, torch.full_like(s, rounding))
    a = torch.softmax(s, 0)
    a2 = torch.softmax(s + eps, 0)
    return a, a2, tail


@given(
    seed=st.integers(0, 10**6),
    n=st.integers(2, 400),
    tail_frac=st.floats(0.0, 1.0),
    delta=st.floats(0.0, 3.0),
    rounding=st.floats(0.0, 1e-3),
    temp=st.floats(0.01, 20.0),
)
def test_key_sum_bound_covers_the_l1_distance(seed, n, tail_frac, delta, rounding, temp):
    a, a2, tail = _perturbed(seed, n, tail_frac, delta, rounding, temp)
    l1 = (a - a2).abs().sum()
    alpha_obs = a2[tail].sum().float()
    d, r = torch.tensor(delta, dtype=torch.float32), torch.tensor(rounding, dtype=torch.float32)
    alpha_up = tail_mass_upper(alpha_obs, d, r)
    assert a[tail].sum() <= alpha_up.double() + 1e-12
    assert l1 <= key_sum_bound(alpha_up, d, r).double() + 1e-12


def test_full_sequence_form_is_tight_for_two_point_masses():
    # worst case of a uniform perturbation |ε| ≤ δ: Σ|a − a'| = 2·tanh(δ/2), at ε = ±δ, p = 1/(1 + e^δ)
    delta = 1.0
    p = 1 / (1 + torch.exp(torch.tensor(delta, dtype=torch.float64)))
    a = torch.tensor([p, 1 - p], dtype=torch.float64)
    a2 = torch.softmax(torch.log(a) + torch.tensor([delta, -delta], dtype=torch.float64), 0)
    l1 = (a - a2).abs().sum()
    bound = key_sum_bound(torch.tensor(1.0), torch.tensor(delta), torch.tensor(0.0))
    assert l1 <= bound.double() <= l1 * 1.01


def test_gamma_and_exp_rounding_are_positive_and_monotone():
    assert 0 < gamma(16) < gamma(128) < 1e-5
    r = exp_rounding(torch.tensor([0.0, 10.0, 100.0]))
    assert (r[1:] > r[:-1]).all() and r[0] >= 4 * UNIT_ROUNDOFF
