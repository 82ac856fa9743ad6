"""Rule aggregate_stats: every chunk's statistics folded in one pass into the tables (TSV, and the report's pages),
the validation page, the token frequencies of the trained tokens and the RMS plot."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from hsextract.prepare.vocab import save_token_freq
from hsextract.report.plots import plot_rms_by_position
from hsextract.report.stats import ChunkTotals, iter_json_files, write_table
from hsextract.report.tables import TITLES, write_report_pages

TABLES = ("summary", "chunks", "layers", "rms_by_position", "seq_lengths", "dropped")


def write_aggregate(prepare_summary: str | Path, chunk_stats: Sequence[str | Path], validation: Sequence[str | Path],
                    out: Mapping[str, str | Path]) -> pd.DataFrame:
    """The rule's outputs (`out`: each table's TSV by name, `<name>_html` for its page and `validation_html`,
    `token_freq`, `rms_plot`); returns the summary table. One chunk's statistics in memory at a time: thousands of
    chunks, each holding up to a vocabulary's counts."""
    summary = json.loads(Path(prepare_summary).read_text(encoding="utf-8"))
    totals = ChunkTotals(iter_json_files(chunk_stats))
    tables = totals.tables(summary)
    for name in TABLES:
        write_table(tables[name], out[name])
    write_report_pages(tables, validation, {name: out[f"{name}_html"] for name in (*TITLES, "validation")})
    save_token_freq(totals.token_freq(), out["token_freq"])
    plot_rms_by_position(tables["rms_by_position"], out["rms_plot"])
    return tables["summary"]


__all__ = ["TABLES", "write_aggregate"]
