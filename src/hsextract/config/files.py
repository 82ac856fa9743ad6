"""Config files named by repeated `--configfile` flags, which Snakemake's command line drops.

The production command is `snakemake --cores 8 --configfile config/kimi.yaml --configfile my-sources.yaml`.
Snakemake's `--configfile` option takes several files after one flag (argparse `nargs="+"`), and a second
flag *replaces* the first one's files: Snakemake alone would run that command without config/kimi.yaml,
silently, as the embedded default plus my-sources.yaml. The Snakefile reads the files of the earlier flags
itself, in command-line order, before the last flag's files (which Snakemake applies), so that both spellings,
`--configfile a b` and `--configfile a --configfile b`, give the same config.
"""

from __future__ import annotations

import json
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


def check_report_ready(argv: Sequence[str], run_dir: str | Path, n_chunks: int | None = None) -> None:
    """`snakemake --report` (not with --report-after-run) of an unfinished run: ConfigError saying so, where the run
    has no dataset.json (Snakemake's own words, "marked for report but does not exist", name a file, not the cause), or
    its dataset.json is older than the run: a shard it lists missing or written after it, or another chunk count
    than the config's `n_chunks` (a report of the earlier dataset would pass for this one)."""
    from hsextract.errors import ConfigError

    if not any(a == "--report" or a.startswith("--report=") for a in argv) or "--report-after-run" in argv:
        return  # --report-after-run (which takes --report too): the run makes its dataset.json first
    manifest = Path(run_dir) / "dataset.json"
    finish = (f"the report shows the whole dataset. Finish the run first (`snakemake --cores N`: only the missing "
              f"chunks are extracted; a failed job's log is under logs/{Path(run_dir).name}/)")
    if not manifest.is_file():
        raise ConfigError(f"snakemake --report: {manifest} does not exist: the run has not finished (a chunk failed, "
                          f"or it has not run yet), and {finish}")
    try:
        listed = json.loads(manifest.read_text(encoding="utf-8"))["shards"]
        written = manifest.stat().st_mtime
        paths = [Path(run_dir) / str(entry["path"]) for entry in listed]
    except (OSError, ValueError, KeyError, TypeError):
        return  # Snakemake's report step reads it and says what is wrong
    if n_chunks is not None and len(listed) != n_chunks:
        raise ConfigError(f"snakemake --report: {manifest} lists {len(listed)} chunks and the config makes {n_chunks}: "
                          f"it describes an earlier run, this one has not finished, and {finish}")
    for shard in paths:
        why = ("is missing" if not shard.is_file() else
               "was written after it" if shard.stat().st_mtime > written else None)
        if why:
            raise ConfigError(f"snakemake --report: {shard}, which {manifest} lists, {why}: the run has not finished "
                              f"since (a chunk failed, or it is being extracted again), and {finish}")


__all__ = ["check_report_ready", "configfile_groups", "earlier_configfiles"]
