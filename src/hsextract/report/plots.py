"""Report figures: sequence-length histogram, per-layer RMS by token position."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on workers; set before pyplot is imported
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from hsextract.atomic import write_atomic


def _save(fig: Any, path: str | Path) -> None:
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110, bbox_inches="tight"))
    plt.close(fig)


def _legend_outside(ax: Any) -> None:
    """Legend to the right of the axes, never over a line or a bar."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)


def seq_length_figure(chunks: Iterable[Mapping[str, Any]], bins: int = 40) -> Any:
    """Histogram of tokens and trained tokens per sample, both series on the same bin edges. `chunks` may be
    read lazily (stats.iter_json_files): only the lengths are kept, as int64."""
    lengths, trained = array("q"), array("q")
    for c in chunks:
        lengths.extend(c["seq_lengths"])
        trained.extend(c["trained_lengths"])
    lengths, trained = np.asarray(lengths, dtype=np.int64), np.asarray(trained, dtype=np.int64)
    edges = np.histogram_bin_edges(np.concatenate([lengths, trained]), bins=bins)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.hist(lengths, bins=edges, alpha=0.75, label="tokens per sample")
    ax.hist(trained, bins=edges, alpha=0.6, label="trained tokens per sample")
    ax.set_xlabel("tokens")
    ax.set_ylabel("samples")
    ax.set_title(f"Sequence lengths ({len(lengths)} samples, {bins} bins)")
    _legend_outside(ax)
    return fig


def plot_seq_length_hist(chunks: Iterable[Mapping[str, Any]], path: str | Path, bins: int = 40) -> None:
    _save(seq_length_figure(chunks, bins), path)


def rms_figure(rms_by_position: pd.DataFrame) -> Any:
    df = rms_by_position[rms_by_position["tokens"] > 0]
    fig, ax = plt.subplots(figsize=(8, 4))
    for col in df.columns[2:]:
        ax.plot(df["position_start"], df[col], marker=".", label=col)
    ax.set_yscale("log")
    ax.set_xlabel("token position (bin start)")
    ax.set_ylabel("RMS of hidden state")
    ax.set_title("Per-layer RMS by position")
    _legend_outside(ax)
    return fig


def plot_rms_by_position(rms_by_position: pd.DataFrame, path: str | Path) -> None:
    _save(rms_figure(rms_by_position), path)
