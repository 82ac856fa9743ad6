"""Snakemake's lock left by a run that was killed without its clean-up (`kill -9`, the SIGHUP of a closed
terminal, the OOM killer, a lost login session): recognized as stale and removed, so that the same command
carries on and reruns only what was not finished (the profile's `rerun-incomplete`).

Snakemake (its default file persistence) writes `.snakemake/locks/N.{input,output}.lock` when a run starts and
removes them when it ends; nothing in them names the run, so a killed run's locks refuse every later run until
`snakemake --unlock`. The workflow's onstart, which Snakemake calls after taking the lock, records the run that
holds it (a file per run in OWNERS: pid, the process's start time, host, boot; runs on disjoint targets may hold
locks side by side); onsuccess and onerror remove the run's record. At the next parse, the lock files are
removed only when all of these hold: every record names this host and its process is gone (the machine rebooted
since, no such pid, or the pid now belongs to a process started at another time), and no lock file is newer
than the newest record (a lock taken since belongs to a run that has not reached onstart yet). Anything else is
left to Snakemake, whose error says to run `snakemake --unlock`. The db persistence backend keeps no lock
files: nothing happens there.
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
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks after boot (/proc/PID/stat, field 22); None if there is no such
    process, "" where /proc is not there."""
    if not Path("/proc/self/stat").exists():
        return ""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the command name start at field 3


def record_owner(workdir: Path, pid: int | None = None) -> None:
    """Called by onstart, once Snakemake holds the lock: who holds it."""
    pid = os.getpid() if pid is None else pid
    write_json_atomic(workdir / OWNERS / f"{pid}.json", {"pid": pid, "start": _start_time(pid),
                                                        "host": socket.gethostname(), "boot": _boot_id()},
                      durable=False)


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
    start = _start_time(pid)
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


def remove_stale_lock(workdir: Path) -> str | None:
    """Remove Snakemake's lock files when every run that took them is gone (module docstring); the line to show
    the user, or None when nothing was removed."""
    locks = sorted((workdir / LOCKS).glob("*.lock")) if (workdir / LOCKS).is_dir() else []
    owners = sorted((workdir / OWNERS).glob("*.json")) if (workdir / OWNERS).is_dir() else []
    if not locks or not owners:
        return None
    try:
        recs = [json.loads(p.read_text()) for p in owners]
        newest_record = max(p.stat().st_mtime_ns for p in owners)
        newest_lock = max(p.stat().st_mtime_ns for p in locks)
    except (OSError, ValueError):
        return None
    if newest_lock > newest_record or not all(isinstance(r, dict) and _gone(r) for r in recs):
        return None
    for p in locks + owners:
        p.unlink(missing_ok=True)
    pids = ", ".join(str(r["pid"]) for r in recs)
    return (f"hsextract: removed Snakemake's lock ({len(locks)} files in {LOCKS}) left by a run that no longer "
            f"exists (pid {pids} on this host, killed before it could release it); carrying on: what that "
            "run finished is kept, the rest reruns")
