"""Small matplotlib helpers so every benchmark writes a PNG next to its JSON."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def bar_chart(
    path: Path,
    title: str,
    left: dict[str, float],
    left_label: str,
    right: dict[str, float] | None = None,
    right_label: str = "",
) -> None:
    """One or two side-by-side bar panels sharing the same category names."""
    panels = [(left, left_label)] + ([(right, right_label)] if right else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (values, label) in zip(axes[0], panels, strict=True):
        names = list(values)
        bars = ax.bar(range(len(names)), [values[n] for n in names], color="#4878d0")
        ax.bar_label(bars, fmt="%.1f")
        ax.set_xticks(range(len(names)), names, rotation=15, ha="right", fontsize=8)
        ax.set_ylabel(label)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def line_chart(
    path: Path,
    title: str,
    x: list[float],
    series: dict[str, list[float]],
    x_label: str,
    y_label: str,
    log_y: bool = False,
) -> None:
    line_panels(path, title, x, [(series, y_label)], x_label, log_y)


def line_panels(
    path: Path,
    title: str,
    x: list[float],
    panels: list[tuple[dict[str, list[float]], str]],
    x_label: str,
    log_y: bool = False,
) -> None:
    """Side-by-side line panels over the same x, one (series, y label) each; one legend."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), squeeze=False)
    for ax, (series, y_label) in zip(axes[0], panels, strict=True):
        for name, values in series.items():
            ax.plot(x, values, marker="o" if len(x) <= 12 else None, label=name)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        if log_y:
            ax.set_yscale("log")
        if len(x) <= 12:
            ax.set_xticks(x)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
