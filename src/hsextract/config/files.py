"""Config files named by repeated `--configfile` flags, which Snakemake's command line drops.

The production command is `snakemake --cores 8 --configfile config/kimi.yaml --configfile my-sources.yaml`.
Snakemake's `--configfile` option takes several files after one flag (argparse `nargs="+"`), and a second
flag *replaces* the first one's files: Snakemake alone would run that command without config/kimi.yaml,
silently, as the embedded default plus my-sources.yaml. The Snakefile reads the files of the earlier flags
itself, in command-line order, before the last flag's files (which Snakemake applies), so that both spellings,
`--configfile a b` and `--configfile a --configfile b`, give the same config.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

FLAGS = ("--configfile", "--configfiles")


def configfile_groups(argv: Sequence[str]) -> list[list[str]]:
    """The files of each `--configfile`/`--configfiles` flag in `argv`, one list per flag, in order."""
    groups: list[list[str]] = []
    current: list[str] | None = None
    for arg in argv:
        name, eq, value = arg.partition("=")
        if name in FLAGS:
            current = [value] if eq else []
            groups.append(current)
        elif arg.startswith("-"):
            current = None
        elif current is not None:
            current.append(arg)
    return groups


def earlier_configfiles(argv: Sequence[str], kept: Sequence[str | Path]) -> list[Path]:
    """Files of every flag but the last, when the last flag's files are what Snakemake kept (`kept`).

    Returns [] when there is one flag or none, or when `argv` does not match what Snakemake parsed (e.g. the
    workflow runs through Snakemake's API, whose argv is someone else's).
    """
    groups = configfile_groups(argv)
    if len(groups) < 2:
        return []
    if [Path(f).absolute() for f in groups[-1]] != [Path(f).absolute() for f in kept]:
        return []
    return [Path(f).absolute() for g in groups[:-1] for f in g]


def check_report_ready(argv: Sequence[str], run_dir: str | Path) -> None:
    """`snakemake --report` (not --report-after-run) of a run without its dataset.json: ConfigError saying the run
    is unfinished (Snakemake's own words, "marked for report but does not exist", name a file, not the cause)."""
    from hsextract.errors import ConfigError

    if not any(a == "--report" or a.startswith("--report=") for a in argv):
        return
    manifest = Path(run_dir) / "dataset.json"
    if not manifest.is_file():
        raise ConfigError(
            f"snakemake --report: {manifest} does not exist: the run has not finished (a chunk failed, or it has not "
            f"run yet), and the report shows the whole dataset. Finish the run first (`snakemake --cores N`: only "
            f"the missing chunks are extracted; a failed job's log is under logs/{Path(run_dir).name}/)")


__all__ = ["check_report_ready", "configfile_groups", "earlier_configfiles"]
