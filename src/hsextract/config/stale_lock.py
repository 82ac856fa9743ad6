"""Snakemake's lock left by a run that was killed without its clean-up (`kill -9`, the SIGHUP of a closed
terminal, the OOM killer, a lost login session): recognized as stale and removed, so that the same command
carries on and reruns only what was not finished (the profile's `rerun-incomplete`).

Snakemake (its default file persistence) writes `.snakemake/locks/N.{input,output}.lock` when a run starts and
removes them when it ends; nothing in them names the run, so a killed run's locks refuse every later run until
`snakemake --unlock`. Every run parses the Snakefile before it takes the lock, so the main process's parse
claims it (`claim`): it first looks for a stale lock, then records itself as a run that may hold the lock (a
file per run in OWNERS: pid, the process's start time, host, boot; runs on disjoint targets may hold locks side
by side); onsuccess and onerror remove the record. A kill at any moment after the parse (the conda
environments of `--sdm conda` are created after the lock, before onstart) thus leaves a record. The lock files
are removed only when all of these hold: there is a record, every record names this host and its process is
gone (the machine rebooted since, no such pid, or the pid now belongs to a process started at another time),
no lock file is newer than the moment the records were read (a run whose record came later took its lock
later), and no job of that run still runs (`orphan_jobs`: a kill of Snakemake's process alone leaves them; the
line said then names them). Anything else is left to Snakemake, whose error says to run `snakemake --unlock`.
With no lock, the records of runs that are gone (dry runs, reports: no onsuccess) are tidied away. The db
persistence backend keeps no lock files: nothing happens there.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from hsextract.atomic import write_json_atomic

OWNERS = Path(".snakemake") / "hsextract-lock-owners"
LOCKS = Path(".snakemake") / "locks"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks after boot (/proc/PID/stat, field 22: a step of the wall clock does
    not move it); None if there is no such process, "" where /proc is not there."""
    if not Path("/proc/self/stat").exists():
        return ""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()  # the command name is any bytes, ")" and spaces among them
    except OSError:
        return None
    return stat.rsplit(b")", 1)[1].split()[19].decode()  # fields after the command name start at field 3


def record_owner(workdir: Path, pid: int | None = None) -> None:
    """Who may hold the lock: a run that has parsed the Snakefile (before Snakemake takes the lock)."""
    pid = os.getpid() if pid is None else pid
    write_json_atomic(workdir / OWNERS / f"{pid}.json", {"pid": pid, "start": process_start(pid),
                                                        "host": socket.gethostname(), "boot": _boot_id()},
                      durable=False)


def claim(workdir: Path) -> str | None:
    """Called by the main process's parse: remove a stale lock (remove_stale_lock), then record this run; the
    line to show the user, or None."""
    said = remove_stale_lock(workdir)
    record_owner(workdir)
    return said


def clear_owner(workdir: Path, pid: int | None = None) -> None:
    """Called by onsuccess and onerror: Snakemake releases the run's lock next."""
    (workdir / OWNERS / f"{os.getpid() if pid is None else pid}.json").unlink(missing_ok=True)


def _gone(rec: dict[str, Any]) -> bool:
    """Whether the recorded process surely no longer runs (False when it cannot be told)."""
    pid = rec.get("pid")
    if not isinstance(pid, int) or rec.get("host") != socket.gethostname():
        return False
    boot = _boot_id()
    if boot and rec.get("boot") and rec["boot"] != boot:
        return True
    start = process_start(pid)
    if start is None:
        return True
    if start:
        return start != rec.get("start")
    try:  # no /proc: a pid taken again by another process reads as alive (the lock is then kept)
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def orphan_jobs(workdir: Path) -> list[tuple[int, str]]:
    """(pid, command line) of the processes that run a job script of a Snakemake in `workdir` (Snakemake runs a
    `script:` rule as `python .../.snakemake/scripts/tmpXXXX.<name>.py` in the working folder). Asked at the parse,
    before this run starts a job of its own: they are another run's, alive although its main process may not be
    (the OOM killer, a `kill -9` of Snakemake's process alone, leave its jobs running)."""
    found: list[tuple[int, str]] = []
    here = workdir.resolve()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(proc / "cwd")) != here:
                continue
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or another user's
            continue
        cmd = " ".join(a.decode(errors="replace") for a in argv if a)
        if ".snakemake/scripts/" in cmd and int(proc.name) != os.getpid():
            found.append((int(proc.name), cmd))
    return sorted(found)


def remove_stale_lock(workdir: Path) -> str | None:
    """Remove Snakemake's lock files when every run that may have taken them is gone (module docstring); the
    line to show the user, or None when nothing was removed."""
    if not (workdir / OWNERS).is_dir():
        return None
    # the moment the records are read, in the file system's own clock and granularity (a shared file system's
    # server may keep another time than this host): a lock file as new or newer was taken after it
    probe = workdir / OWNERS / f".read-{os.getpid()}"
    try:
        probe.touch()
        read_at = probe.stat().st_mtime_ns
        probe.unlink()
    except OSError:
        return None
    owners = sorted((workdir / OWNERS).glob("*.json"))
    locks = sorted((workdir / LOCKS).glob("*.lock")) if (workdir / LOCKS).is_dir() else []
    if not owners:
        return None
    try:
        recs = [json.loads(p.read_text(encoding="utf-8")) for p in owners]
        newest_lock = max((p.stat().st_mtime_ns for p in locks), default=0)
    except (OSError, ValueError):
        return None
    gone = [isinstance(r, dict) and _gone(r) for r in recs]
    if not locks:
        for p, g in zip(owners, gone, strict=True):
            if g:
                p.unlink(missing_ok=True)
        return None
    if newest_lock >= read_at or not all(gone):
        return None
    if jobs := orphan_jobs(workdir):
        pids = " ".join(str(pid) for pid, _ in jobs)
        return (f"hsextract: Snakemake's lock was left by a run whose main process is gone, but its jobs still run "
                f"({'; '.join(f'pid {pid}: {cmd}' for pid, cmd in jobs)}); the lock is kept, so that no job "
                f"runs twice. Wait for them to end, or stop them (`kill {pids}`), then run the same command again")
    for p in locks + owners:
        p.unlink(missing_ok=True)
    pids = ", ".join(str(r["pid"]) for r in recs)
    return (f"hsextract: removed Snakemake's lock ({len(locks)} files in {LOCKS}) left by a run that no longer "
            f"exists (pid {pids} on this host, killed before it could release it); carrying on: what that "
            "run finished is kept, the rest reruns")
