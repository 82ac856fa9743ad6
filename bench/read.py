"""Trainer read benchmark: a training-style DataLoader over the same samples stored three ways, side by side.

Samples: speculators v1 dicts (int64 input_ids and loss_mask, 4 bf16 hidden tensors [seq, H]) of synthetic
LLM-like activations (bench/codec.py's generator: per-channel log-normal scales, outlier channels), H = 7168,
lengths drawn from 512..2048 tokens in steps of 256 until `--gb` GB of raw sample bytes. Stores:
  ours         ShardWriter shards (level 3, `--per-shard` samples per shard as the workflow's chunks), read
               through hsextract.open_dataset;
  ours tN      the same shards, open_dataset(decode_threads=N) (`--decode-threads`, default 4): each worker
               decodes a sample's hidden tensors on N threads;
  ours stream tN  the same again as open_dataset(decode_threads=N).stream(readahead=R, prefetch=P)
               (`--readahead`, default 2; `--prefetch`, default 4): an IterableDataset that shuffles every
               epoch itself, decodes each worker's next R samples while the loader collates the current one and
               asks the disk for the records of the P after those; several `--prefetch` values give one
               store each ("ours stream tN pP");
  .pt          speculators v1: one torch.save per sample (hsextract.export "speculators-v1"), read with
               torch.load(weights_only=True, mmap=False);
  safetensors  speculators >= 0.5: one safetensors file per sample, hidden states stacked [seq, 4, H]
               (hsextract.export "speculators-safetensors"), read with safetensors.torch.load_file, the
               loss mask from the export's Arrow table (read once).
Each store is read by a DataLoader (shuffle=True, persistent workers; the stream: no shuffle argument, it
shuffles itself) with 1, 2 and 4 workers (`--workers`), and `--batch 1 none` (default 1): batch_size=1 with
the default collate, and/or batch_size=None, no collation (rows "N uncollated"; the stream as
stream(batch_size=None), which decodes into shared memory). `--stores` picks the stores (the .pt baseline is
always read). One untimed epoch first (it reads every file, so the page cache is warm and the workers are
started), then a timed epoch from the page cache ("warm"), then the store's files are dropped from the page
cache and a timed epoch reads them from disk ("cold"). Dropping: `sync` and `echo 1 >
/proc/sys/vm/drop_caches` where permitted, else fsync + posix_fadvise(POSIX_FADV_DONTNEED) on every file of
the store; the output says which was used and how much of the store stayed resident (fincore). Speeds:
samples/s and GB/s of decoded hidden-state bytes (4 x seq x H x 2) per wall second of an epoch. Then (unless
--no-profile) one process reads our shards in a shuffled order under cProfile, and the time is split into
stages: file read (pread), checksums (xxh3, crc32), zstd decompress, byte-plane reassembly, tensor
construction; and in one process, alternating, decode_threads 1, 2 and N: samples per wall second and per CPU
second.

    PYTHONPATH=src python bench/read.py [--gb 1.5] [--workers 1 2 4] [--out read.json] [--write-readme]
    PYTHONPATH=src python bench/read.py --dry   # seconds: tiny samples, for tests/test_bench_dryrun.py

Length: the stores, the epochs and the profile read the same samples in one run, so the ratios compare like with
like; one script.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import random
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import pyarrow as pa
import safetensors
import torch
import zstandard as zstd
from codec import cpu_name, synthetic_samples  # bench/ is the script's folder
from pagecache import drop_method, evict, resident_bytes  # bench/ is the script's folder
from safetensors.torch import load_file
from shard_meta import placeholder_metadata  # bench/ is the script's folder
from torch.utils.data import DataLoader, Dataset, IterableDataset

from hsextract.dataset import SampleStream, open_dataset
from hsextract.export import export
from hsextract.shard import ShardWriter

ROOT = Path(__file__).resolve().parents[1]
N_HIDDEN = 4


# -- the samples, stored three ways ---------------------------------------------------------------------------
def sample_lengths(gb: float, hidden: int, lo: int, hi: int, step: int, seed: int = 0) -> list[int]:
    """Lengths drawn uniformly from lo..hi (multiples of `step`) until the raw bytes reach `gb` GB (at least 2)."""
    rng = random.Random(seed)
    per_token = N_HIDDEN * hidden * 2 + 16
    choices = list(range(lo, hi + 1, step))
    lens: list[int] = []
    while len(lens) < 2 or sum(lens) * per_token < gb * 1e9:
        lens.append(rng.choice(choices))
    return lens


def write_shards(folder: Path, lens: list[int], hidden: int, per_shard: int) -> None:
    """Samples of each length come from bench/codec.py's generator, one call per length (so the peak memory is
    one length's samples); they are interleaved in the order `lens` drew them."""
    folder.mkdir(parents=True)
    by_len = {n: synthetic_samples(n * lens.count(n), n, hidden)[0][::-1] for n in sorted(set(lens))}
    meta = placeholder_metadata(hidden, [2, 4, 6], final_state="pre_norm")  # the state speculators expects
    writer: ShardWriter | None = None
    for i, n in enumerate(lens):
        if i % per_shard == 0:
            if writer is not None:
                writer.close()
            writer = ShardWriter(folder / f"chunk-{i // per_shard:05d}.hss", meta, level=3)
        s = by_len[n].pop()
        writer.add(s["input_ids"], s["hidden_states"], s["loss_mask"])  # type: ignore[union-attr]
    assert writer is not None
    writer.close()


class PtFiles(Dataset):
    """speculators v1: one torch.save'd dict per sample."""

    def __init__(self, folder: Path) -> None:
        self.files = sorted(folder.glob("data_*.pt"), key=lambda p: int(p.stem[5:]))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return torch.load(self.files[i], weights_only=True, mmap=False)


class SafetensorsFiles(Dataset):
    """speculators >= 0.5: hidden_states/hs_{i}.safetensors, the loss masks in the Arrow table."""

    def __init__(self, folder: Path) -> None:
        hs = folder / "hidden_states"
        self.files = sorted(hs.glob("hs_*.safetensors"), key=lambda p: int(p.stem[3:]))
        with pa.OSFile(str(folder / "data-00000-of-00001.arrow")) as f:
            self.masks = pa.ipc.open_stream(f).read_all().column("loss_mask")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        d = load_file(self.files[i])
        mask = torch.from_numpy(self.masks[i].values.to_numpy(zero_copy_only=False).copy())
        return {"input_ids": d["token_ids"], "hidden_states": d["hidden_states"], "loss_mask": mask}


def threaded(threads: int) -> str:
    return f"ours t{threads}"


def streamed(threads: int, prefetch: int | None = None) -> str:
    return f"ours stream t{threads}" + ("" if prefetch is None else f" p{prefetch}")


STORES = ("ours", "threaded", "stream", "pt", "safetensors")  # --stores: the .pt baseline is always read


def build_stores(folder: Path, lens: list[int], hidden: int, per_shard: int, decode_threads: int, readahead: int,
                 prefetch: list[int], wanted: list[str]) -> dict[str, dict[str, Any]]:
    shards = folder / "shards"
    write_shards(shards, lens, hidden, per_shard)
    export(shards, folder / "pt", "speculators-v1")
    files = sorted(shards.glob("*.hss"))
    stores: dict[str, dict[str, Any]] = {}
    if "ours" in wanted:
        stores["ours"] = {"dataset": open_dataset(shards), "files": files}
    if "threaded" in wanted:
        stores[threaded(decode_threads)] = {"dataset": open_dataset(shards, decode_threads=decode_threads),
                                            "files": files}
    if "stream" in wanted:
        for p in prefetch:
            stores[streamed(decode_threads, p if len(prefetch) > 1 else None)] = {
                "dataset": open_dataset(shards, decode_threads=decode_threads).stream(readahead=readahead,
                                                                                      prefetch=p),
                "files": files}
    stores[".pt"] = {"dataset": PtFiles(folder / "pt" / "data"),
                     "files": sorted((folder / "pt" / "data").glob("*.pt"))}
    if "safetensors" in wanted:
        export(shards, folder / "st", "speculators-safetensors")
        stores["safetensors"] = {"dataset": SafetensorsFiles(folder / "st"),
                                 "files": sorted((folder / "st" / "hidden_states").glob("*.safetensors"))}
    for s in stores.values():
        s["bytes"] = sum(p.stat().st_size for p in s["files"])
    check_same_samples(shards, stores, len(lens))
    return stores


def hidden_list(s: dict[str, Any]) -> list[torch.Tensor]:
    h = s["hidden_states"]
    return list(h.unbind(-2)) if isinstance(h, torch.Tensor) else list(h)  # safetensors: [(1,) seq, 4, H]


def check_same_samples(shards: Path, stores: dict[str, dict[str, Any]], n: int) -> None:
    """The first and last sample are equal in our shards and every map-style store, tensor by tensor (so the
    stores hold the same data; the streams read our shards through the same reader)."""
    ours = open_dataset(shards)
    for i in (0, n - 1):
        ref = ours[i]
        for name in [k for k, v in stores.items() if not isinstance(v["dataset"], IterableDataset)]:
            got = stores[name]["dataset"][i]
            same = torch.equal(got["input_ids"], ref["input_ids"]) and torch.equal(got["loss_mask"], ref["loss_mask"])
            same = same and all(torch.equal(a, b) for a, b in zip(hidden_list(got), ref["hidden_states"], strict=True))
            if not same:
                raise RuntimeError(f"sample {i} of store {name} differs from ours")


# -- DataLoader epochs ----------------------------------------------------------------------------------------
def epoch(loader: DataLoader, n: int) -> tuple[float, int, float, float, float]:
    """Wall seconds of one pass and the hidden-state bytes it delivered (checked: every sample exactly once),
    samples/s and bytes/s in its steady part: between the arrivals of its (n/10)-th and its (n - n/10)-th sample
    (a long epoch's rate, without the workers' fill at the start and their drain at the end), and the seconds to
    its first sample."""
    arrivals = [0.0]  # seconds since the start at which the first k samples had arrived
    sizes = []
    t0 = time.perf_counter()
    for batch in loader:
        arrivals.append(time.perf_counter() - t0)
        sizes.append(sum(h.numel() * h.element_size() for h in hidden_list(batch)))
    if len(sizes) != n:
        raise RuntimeError(f"epoch delivered {len(sizes)} samples, the dataset holds {n}")
    a, b = n // 10, n - n // 10
    span = arrivals[b] - arrivals[a]
    return arrivals[-1], sum(sizes), (b - a) / span, sum(sizes[a:b]) / span, arrivals[1]


def loader(dataset: Any, workers: int, batch: str) -> DataLoader:
    """The store's DataLoader: batch "1" collates each sample into a batch of one (the default collate), "none"
    hands samples over as they are (batch_size=None); a stream is told which (it shuffles itself)."""
    size = 1 if batch == "1" else None
    if isinstance(dataset, SampleStream):
        return DataLoader(dataset.dataset.stream(readahead=dataset.readahead, prefetch=dataset.prefetch,
                                                 batch_size=size), batch_size=size, num_workers=workers,
                          persistent_workers=True)
    return DataLoader(dataset, batch_size=size, num_workers=workers, persistent_workers=True, shuffle=True,
                      generator=torch.Generator().manual_seed(workers))


def measure(stores: dict[str, dict[str, Any]], workers: list[int], batches: list[str], method: str, repeats: int,
            n: int) -> dict[str, Any]:
    """cells[cache][row][store], row the worker count ("4"; "4 uncollated" for batch "none"): the best of
    `repeats` epochs; the stores' epochs alternate, so a change of load on the machine hits all of them alike."""
    cells: dict[str, Any] = {"warm": {}, "cold": {}}
    resident: dict[str, list[int]] = {s: [] for s in stores}
    read_back: dict[str, list[float]] = {s: [] for s in stores}
    for w, batch in [(w, b) for b in batches for w in workers]:
        row = str(w) if batch == "1" else f"{w} uncollated"
        loaders = {name: loader(stores[name]["dataset"], w, batch) for name in stores}
        for name in stores:
            epoch(loaders[name], n)  # warms the page cache and starts the workers
        best: dict[str, dict[str, list[tuple[float, int, float, float, float]]]] = {"warm": {}, "cold": {}}
        for cache in best:
            for _ in range(repeats):
                for name in stores:
                    if cache == "cold":
                        evict(stores[name]["files"], method)
                        left = resident_bytes(stores[name]["files"])
                        if left is not None:
                            resident[name].append(left)
                    before = disk_read_bytes() if cache == "cold" else None
                    best[cache].setdefault(name, []).append(epoch(loaders[name], n))
                    if before is not None:
                        read_back[name].append((disk_read_bytes() - before) / stores[name]["bytes"])
        for cache, by_store in best.items():  # each figure the best of the repeats
            cells[cache][row] = {name: _best(runs, n) for name, runs in by_store.items()}
        del loaders  # shuts the workers down before the next worker count starts its own
    return {"cells": cells, "resident_after_evict": {k: max(v) if v else None for k, v in resident.items()},
            "disk_read_per_store_byte": {k: [min(v), max(v)] if v else None for k, v in read_back.items()}}


def _best(runs: list[tuple[float, int, float, float, float]], n: int) -> dict[str, float]:
    """One cell from a store's epochs (wall s, bytes, steady samples/s, steady bytes/s, first sample s): the best
    of each."""
    wall = min(e[0] for e in runs)
    return {"samples_s": n / wall, "gb_s": max(e[1] / e[0] for e in runs) / 1e9, "wall_s": wall,
            "steady_samples_s": max(e[2] for e in runs), "steady_gb_s": max(e[3] for e in runs) / 1e9,
            "first_s": min(e[4] for e in runs)}


def disk_read_bytes() -> int | None:
    """Bytes read from this machine's disks so far (/sys/block/*/stat, 512-byte sectors; not loop, ram or zram
    devices), or None where there is no such file: read around a cold epoch, it says how much of the disk's work
    the store's bytes were."""
    stats = [p for p in Path("/sys/block").glob("*/stat") if not p.parent.name.startswith(("loop", "ram", "zram"))]
    return sum(int(p.read_text(encoding="utf-8").split()[2]) for p in stats) * 512 if stats else None


# -- where our read time goes ---------------------------------------------------------------------------------
STAGES = (  # (stage, substrings of cProfile function names whose own time counts for it)
    ("file read (pread)", ("posix.pread",)),
    ("checksums (xxh3, crc32)", ("xxh3", "zlib.crc32")),
    ("zstd decompress", ("ZstdDecompressor",)),
    ("byte-plane reassembly", ("join_planes", "numpy.frombuffer", "numpy.empty")),
    ("tensor construction", ("torch.from_numpy", "'view' of 'torch", "TensorBase", "_tensor")),
)


def profile_ours(ds: Any, n: int) -> dict[str, Any]:
    """One process reads every sample of our shards in a shuffled order: plain wall time, then under cProfile
    with the time split into STAGES (each function's own time; the rest is Python glue)."""
    order = list(range(n))
    random.Random(1).shuffle(order)
    for i in order:  # page cache warm, decompressor created
        ds[i]
    t0 = time.perf_counter()
    for i in order:
        ds[i]
    plain = time.perf_counter() - t0
    prof = cProfile.Profile()
    prof.enable()
    for i in order:
        ds[i]
    prof.disable()
    st = pstats.Stats(prof)
    total = 0.0
    split = {stage: 0.0 for stage, _ in STAGES}
    for (file, _, func), (_, _, tottime, _, _) in st.stats.items():  # type: ignore[attr-defined]
        total += tottime
        where = f"{file}:{func}"
        for stage, keys in STAGES:
            if any(k in where for k in keys):
                split[stage] += tottime
                break
    split["other (Python glue, checks)"] = total - sum(split.values())
    return {"samples_s_in_process": n / plain, "profiled_s": total,
            "split": {k: v / total for k, v in split.items()}}


def decode_threads(shards: list[Path], n: int, threads: list[int], repeats: int) -> dict[str, Any]:
    """Our shards from the page cache in one process, shuffled, by decode_threads, alternating, best of
    `repeats` + 1: samples per wall second and per CPU second of the process (all its threads)."""
    variants = {t: open_dataset(shards, decode_threads=t) for t in threads}
    order = list(range(n))
    random.Random(2).shuffle(order)
    for ds in variants.values():
        ds[order[0]]  # decode threads started
    best: dict[int, tuple[float, float]] = {t: (float("inf"), float("inf")) for t in threads}
    for _ in range(repeats + 1):
        for t, ds in variants.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for i in order:
                ds[i]
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            best[t] = (min(best[t][0], wall), min(best[t][1], cpu))
    return {str(t): {"samples_s": n / wall, "samples_per_cpu_s": n / cpu} for t, (wall, cpu) in best.items()}


# -- report ---------------------------------------------------------------------------------------------------
def machine() -> str:
    return (f"machine: {cpu_name()}, {os.cpu_count()} logical cores visible, torch {torch.__version__}, "
            f"zstd {'.'.join(map(str, zstd.ZSTD_VERSION))}, safetensors {safetensors.__version__}, "
            f"Python {platform.python_version()}")


def markdown(res: dict[str, Any]) -> str:
    sizes = res["stores"]
    names = list(next(iter(res["cells"]["warm"].values())))  # ours, ours tN, ours stream tN, then the baselines
    ours = [s for s in names if s.startswith("ours")]
    raw = res["raw_bytes"]
    # the JSON of runs before the steady figures has none: their table leaves the columns out
    some = next(iter(next(iter(res["cells"]["warm"].values())).values()))
    steady, first = "steady_samples_s" in some, "first_s" in some
    lines = [
        res["machine"] + f"; load average {res['load_before']} before, {res['load_after']} after",
        "",
        f"{res['samples']} samples, {res['tokens']} tokens (lengths {res['min_len']}..{res['max_len']}), H = "
        f"{res['hidden']}, 4 bf16 hidden tensors: {res['hidden_bytes'] / 1e9:.2f} GB of hidden states per epoch; "
        + "; ".join(f"{k} {v['bytes'] / 1e9:.2f} GB on disk ({v['bytes'] / raw:.3f} of raw)" for k, v in sizes.items())
        + f". Cold cache by {res['evict_method']}"
        + (", resident after it: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in res["resident_after_evict"].items()
                                               if v is not None)
           if any(v is not None for v in res["resident_after_evict"].values()) else "")
        + f". Each cell: the best of {res.get('repeats', '?')} epochs."
        + ("" if not any(res.get("disk_read_per_store_byte", {}).values()) else
           " Bytes read from the disks per byte of the store in its cold epochs (min-max; other processes' reads "
           "count too): " + ", ".join(f"{k} {v[0]:.3f}-{v[1]:.3f}" for k, v in res["disk_read_per_store_byte"].items()
                                     if v)),
        "",
        "GB/s of hidden states delivered by the DataLoader over the epoch (samples/s in the JSON); the ratios are "
        "of samples/s" + (", over the epoch and in its steady part (\"steady\": between the arrivals of its "
                          "n/10-th and (n - n/10)-th sample, without the workers' fill and drain)."
                          if steady else ".")
        + (" First: milliseconds from the epoch's start to its first sample." if first else ""),
        "",
        "| cache | workers | " + " | ".join(f"{s} GB/s" for s in names) + " | "
        + " | ".join(f"{s} / .pt" + (f" | {s} / .pt steady" if steady else "") for s in ours)
        + "".join(f" | {s} first ms" for s in names if first) + " |",
        "|---|---|" + "---|" * (len(names) + (1 + steady) * len(ours) + first * len(names)),
    ]
    for cache, by_w in res["cells"].items():
        for w, row in by_w.items():
            cells = " | ".join(f"{row[s]['gb_s']:.2f}" for s in names)
            ratios = " | ".join(f"{row[s]['samples_s'] / row['.pt']['samples_s']:.2f}"
                                + (f" | {row[s]['steady_samples_s'] / row['.pt']['steady_samples_s']:.2f}"
                                   if steady else "") for s in ours)
            firsts = "".join(f" | {row[s]['first_s'] * 1e3:.0f}" for s in names if first)
            lines.append(f"| {cache} | {w} | {cells} | {ratios}{firsts} |")
    if "profile" not in res:
        return "\n".join(lines)
    p = res["profile"]
    lines += [
        "",
        f"Our read path, one process, shuffled, page cache warm: {p['samples_s_in_process']:.2f} samples/s "
        f"({p['samples_s_in_process'] * res['hidden_bytes'] / res['samples'] / 1e9:.2f} GB/s of hidden states) "
        "without the DataLoader; under cProfile the time splits:",
        "",
        "| stage | share |",
        "|---|---|",
        *(f"| {k} | {v:.1%} |" for k, v in p["split"].items()),
        "",
        "Our shards from the page cache in one process (no DataLoader), shuffled, by `decode_threads`:",
        "",
        "| decode_threads | samples/s | samples per CPU second | speed-up |",
        "|---|---|---|---|",
        *(f"| {t} | {v['samples_s']:.2f} | {v['samples_per_cpu_s']:.2f} | "
          f"{v['samples_s'] / res['decode_threads']['1']['samples_s']:.2f} |"
          for t, v in res["decode_threads"].items()),
    ]
    return "\n".join(lines)


def load() -> str:
    loadavg = Path("/proc/loadavg")
    return " ".join(loadavg.read_text(encoding="utf-8").split()[:3]) if loadavg.exists() else "?"


def run(a: argparse.Namespace) -> dict[str, Any]:
    lens = sample_lengths(a.gb, a.hidden, a.min_len, a.max_len, a.step)
    res: dict[str, Any] = {"machine": machine(), "load_before": load(), "samples": len(lens), "tokens": sum(lens),
                           "min_len": min(lens), "max_len": max(lens), "hidden": a.hidden,
                           "hidden_bytes": sum(lens) * N_HIDDEN * a.hidden * 2,
                           "raw_bytes": sum(lens) * (N_HIDDEN * a.hidden * 2 + 16), "workers": a.workers,
                           "repeats": a.repeats, "readahead": a.readahead, "prefetch": a.prefetch,
                           "batches": a.batch}
    folder = Path(tempfile.mkdtemp(prefix="hsx-read-", dir=a.dir))
    try:
        stores = build_stores(folder, lens, a.hidden, a.per_shard, a.decode_threads, a.readahead, a.prefetch,
                              a.stores)
        shards = sorted((folder / "shards").glob("*.hss"))
        res["stores"] = {"ours": {"bytes": sum(p.stat().st_size for p in shards), "files": len(shards)}} | {
            k: {"bytes": v["bytes"], "files": len(v["files"])} for k, v in stores.items()
            if not k.startswith("ours")}
        res["evict_method"] = drop_method() if a.evict == "auto" else a.evict
        res.update(measure(stores, a.workers, a.batch, res["evict_method"], a.repeats, len(lens)))
        if a.profile:
            res["profile"] = profile_ours(open_dataset(shards), len(lens))
            res["decode_threads"] = decode_threads(shards, len(lens), sorted({1, 2, a.decode_threads}), a.repeats)
    finally:
        shutil.rmtree(folder)
    res["load_after"] = load()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.5, help="raw sample bytes to store, in GB (each store)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--step", type=int, default=256, help="sample lengths are multiples of this")
    ap.add_argument("--per-shard", type=int, default=64, help="samples per shard (the workflow's prompts_per_chunk)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--decode-threads", type=int, default=4,
                    help="decode threads per worker of the `ours tN` and `ours stream tN` stores")
    ap.add_argument("--readahead", type=int, default=2, help="samples each worker of the stream decodes ahead")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[4],
                    help="samples after those whose records each stream worker asks of the disk (one stream store "
                         "per value)")
    ap.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES),
                    help="stores to read (the .pt baseline always is): ours, threaded (ours tN), stream (ours "
                         "stream tN), pt, safetensors")
    ap.add_argument("--batch", nargs="+", choices=["1", "none"], default=["1"],
                    help="DataLoader batch_size: 1 (the default collate: each sample copied into a batch of one) "
                         "and/or none (uncollated: samples handed over as they are; rows marked 'uncollated')")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the one-process profile and the decode_threads table")
    ap.add_argument("--repeats", type=int, default=2, help="timed epochs per cell (the best is kept)")
    ap.add_argument("--evict", choices=["auto", "drop_caches", "fadvise"], default="auto",
                    help="how to empty the page cache for the cold epochs (auto: drop_caches where permitted)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the stores are written (a real disk)")
    ap.add_argument("--dry", action="store_true", help="tiny samples (H 256, 16..64 tokens) and --evict fadvise, "
                    "for the tests")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument("--from-json", default=None, help="measure nothing: render the tables of an --out file")
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--write-readme", action="store_true", help="replace the read table in bench/README.md")
    a = ap.parse_args()
    if a.dry:
        a.gb, a.hidden, a.min_len, a.max_len, a.step, a.per_shard = 0.0005, 256, 16, 64, 16, 4
        a.evict = "fadvise" if a.evict == "auto" else a.evict  # a test must not empty the whole machine's cache
    # 4 workers on 2 cores is what the run measures, on purpose
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    res = json.loads(Path(a.from_json).read_text(encoding="utf-8")) if a.from_json else run(a)
    table = markdown(res)
    print(table)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1), encoding="utf-8")
    if a.md:
        Path(a.md).write_text(table + "\n", encoding="utf-8")
    if a.write_readme:
        readme = ROOT / "bench" / "README.md"
        text = readme.read_text(encoding="utf-8")
        start, end = "<!-- read-table:start -->", "<!-- read-table:end -->"
        block = f"{start}\n{table}\n{end}"
        text = (text[: text.index(start)] + block + text[text.index(end) + len(end):] if start in text
                else f"{text}\n{block}\n")
        readme.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
