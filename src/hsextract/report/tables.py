"""The run's tables as small HTML pages: Snakemake's report shows an HTML output inline (a TSV only as a
download link). One page per table, plus the validation summary over every shard's report."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from hsextract.atomic import write_atomic
from hsextract.report.stats import load_json_files
from hsextract.report.validate import CHECKS

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; font-size: 14px; margin: 8px; color: #222; }
h1 { font-size: 16px; margin: 0 0 8px 0; }
p { margin: 4px 0 8px 0; }
table { border-collapse: collapse; }
th, td { padding: 3px 10px; border-bottom: 1px solid #ddd; }
th { text-align: left; background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.passed { color: #17692b; font-weight: 600; }
.failed { color: #a21919; font-weight: 600; }
"""


def _cell(value: Any) -> tuple[str, bool]:
    """(text, numeric) of one table cell: integers with thousands separators, floats to 4 significant digits."""
    if isinstance(value, bool):
        return str(value), False
    if isinstance(value, int) or (hasattr(value, "dtype") and getattr(value.dtype, "kind", "") in "iu"):
        return f"{int(value):,}", True
    if isinstance(value, float) or (hasattr(value, "dtype") and getattr(value.dtype, "kind", "") == "f"):
        v = float(value)
        return ("nan" if v != v else f"{v:.4g}"), True
    return str(value), False


def table_html(df: pd.DataFrame) -> str:
    """An HTML table of `df` (no index), numbers right-aligned."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    rows = []
    for record in df.itertuples(index=False):
        cells = []
        for value in record:
            text, numeric = _cell(value)
            cells.append(f'<td class="num">{html.escape(text)}</td>' if numeric else f"<td>{html.escape(text)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head>\n<body><h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n"
    )


def write_page(path: str | Path, title: str, body: str) -> None:
    text = page(title, body).encode()
    write_atomic(path, lambda f: f.write(text))


def validation_summary(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Over the shards' validation reports: shards passed, and per check the shards that passed it and the
    samples that failed it."""
    checks = {c: {"shards_passed": 0, "samples_failed": 0} for c in CHECKS}
    for r in reports:
        for name, result in r["checks"].items():
            entry = checks.setdefault(name, {"shards_passed": 0, "samples_failed": 0})
            entry["shards_passed"] += result["failed"] == 0
            entry["samples_failed"] += int(result["failed"])
    return {
        "shards": len(reports),
        "passed": sum(bool(r["passed"]) for r in reports),
        "samples": sum(int(r["num_samples"] or 0) for r in reports),
        "checks": checks,
        "failed": [str(r["shard"]) for r in reports if not r["passed"]],
    }


def validation_html(summary: Mapping[str, Any]) -> str:
    n, ok = summary["shards"], summary["passed"]
    css = "passed" if ok == n else "failed"
    rows = pd.DataFrame(
        [{"check": c, "shards passed": v["shards_passed"], "samples failed": v["samples_failed"]}
         for c, v in summary["checks"].items()]
    )
    failed = "".join(f"<li>{html.escape(p)}</li>" for p in summary["failed"])
    return (
        f'<p class="{css}">{ok} of {n} shards passed validation ({summary["samples"]:,} samples).</p>\n'
        + (f"<p>Failed shards:</p><ul>{failed}</ul>\n" if failed else "")
        + table_html(rows)
    )


TITLES = {
    "summary": "Totals",
    "chunks": "Per chunk",
    "layers": "Per stored tensor",
    "seq_lengths": "Sequence-length quantiles",
    "dropped": "Dropped by prepare (whole records, or samples of a record)",
}


def write_report_pages(
    tables: Mapping[str, pd.DataFrame], validation_reports: Iterable[str | Path], paths: Mapping[str, str | Path]
) -> None:
    """One page per table of `ChunkTotals.tables` (keys of TITLES) and the validation summary, to `paths`."""
    for name, title in TITLES.items():
        df = tables[name]
        body = table_html(df) if len(df) else "<p>None.</p>"
        write_page(paths[name], title, body)
    summary = validation_summary(load_json_files(validation_reports))
    write_page(paths["validation"], "Validation", validation_html(summary))
