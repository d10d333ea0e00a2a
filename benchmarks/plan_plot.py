"""The plot of a `pdcluster plan` run: SLO attainment and TTFT p90 against the modeled rate,
one line per split."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.benchmarks.plan import SplitResult


def plot(results: list[SplitResult], slo_ttft_ms: float, target: float, path: Path) -> None:
    """Attainment (left) and TTFT p90 (right, log scale, the SLO dashed) per split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for r in results:
        rates = [p.rate_rps for p in r.points]
        left.plot(rates, [p.attainment for p in r.points], "o-", label=r.split.name)
        ttft = [(p.rate_rps, p.ttft_p90_ms) for p in r.points if p.ttft_p90_ms is not None]
        if ttft:
            right.plot(*zip(*ttft), "o-", label=r.split.name)
    left.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"{target:.0%}")
    left.set(xlabel="modeled rate (req/s)", ylabel="SLO attainment", ylim=(-0.02, 1.02))
    right.axhline(slo_ttft_ms, color="gray", linestyle="--", linewidth=1, label="TTFT SLO")
    right.set(xlabel="modeled rate (req/s)", ylabel="TTFT p90 (modeled ms)", yscale="log")
    for ax in (left, right):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
