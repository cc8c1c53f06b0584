"""Grouped bar charts of the benchmarks' tables (`--plot FILE.png`), with matplotlib: an optional
dependency (`pip install 'specdecode[plot]'`), imported only when a plot is asked for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdecode.errors import SpecDecodeError


@dataclass
class Panel:
    """One chart: a group of bars per category, a bar per series (label, one value a category).
    `reference`: a dashed horizontal line (1.0 for speedups), or None."""

    ylabel: str
    categories: list[str]
    series: list[tuple[str, list[float]]]
    reference: float | None = None


def draw(file: str, panels: Sequence[Panel]) -> None:
    """The panels one above the other, written to `file` (PNG)."""
    try:
        import matplotlib
    except ImportError:
        raise SpecDecodeError("--plot needs matplotlib: pip install 'specdecode[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widest = max(len(p.categories) for p in panels)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(max(8, 1.4 * widest) + 3, 4.5 * len(panels)), squeeze=False
    )
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        width = 0.8 / max(len(panel.series), 1)
        for i, (label, values) in enumerate(panel.series):
            ax.bar([x + i * width for x in range(len(panel.categories))], values, width, label=label)
        middle = width * (len(panel.series) - 1) / 2
        ax.set_xticks([x + middle for x in range(len(panel.categories))], panel.categories, rotation=20)
        if panel.reference is not None:
            ax.axhline(panel.reference, color="black", linestyle="--", linewidth=0.8)
        ax.set_ylabel(panel.ylabel)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
    fig.tight_layout()
    fig.savefig(file, dpi=120)
    plt.close(fig)
