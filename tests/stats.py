"""Statistics shared by the distribution tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALPHA = 1e-4  # chi-square p-value below which a distribution is rejected


@dataclass(frozen=True)
class DistributionCheck:
    """How `n` samples compare with an exact distribution: the chi-square test's p-value, and
    their total variation from it against a bound that an exact sampler stays under."""

    n: int
    p_value: float
    tv: float
    tv_bound: float

    @property
    def ok(self) -> bool:
        return self.p_value > ALPHA and self.tv < self.tv_bound


def chi_square_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, stat/2)."""
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )
