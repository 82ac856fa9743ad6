"""dataset.json's checks of a run folder (hsextract.report.manifest): each shard against the prompts file of its chunk,
and the per-chunk files an earlier configuration of more chunks left behind."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import make_sample, shard_metadata

from hsextract import open_dataset
from hsextract.config.settings import Settings, from_config
from hsextract.errors import ValidationFailure
from hsextract.prepare.run import SCHEMA
from hsextract.prepare.vocab import save_token_freq
from hsextract.provenance import sha256_file
from hsextract.report.manifest import build_manifest, remove_stale_chunks
from hsextract.report.stats import ChunkTotals, chunk_stats
from hsextract.shard import ShardWriter

SETTINGS = from_config({"capture": "custom", "aux_layers": [1, 2, 3], "aux_layers_convention": "hidden_states"})


def write_prompts(path: Path, chunk: int, shift: int = 0) -> None:
    """A chunk's prompts parquet of two rows (`shift` added to every input id: other prompts)."""
    ids = [[t + shift for t in make_sample(5 + chunk, seed=10 * chunk + k)[0].tolist()] for k in range(2)]
    rows = [{"sample_id": f"d:{2 * chunk + k}", "input_ids": x, "loss_mask": [1] * len(x), "num_tokens": len(x),
             "num_trained": len(x), "source": "d"} for k, x in enumerate(ids)]
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)


def make_run(root: Path, n_chunks: int, *, recorded: tuple[int, ...] | None = None) -> Path:
    """A run folder of `n_chunks` chunks as the workflow lays it out: prompts, shards (those of chunks in `recorded`,
    every one by default, record their prompts' sha256, as extract does; the others are an earlier release's),
    validation reports, statistics, the prepare summary and token frequencies."""
    run = root / "results" / "r"
    for folder in ("prompts", "shards", "validation", "stats"):
        (run / folder).mkdir(parents=True, exist_ok=True)
    for c in range(n_chunks):
        prompts = run / "prompts" / f"chunk-{c:05d}.parquet"
        write_prompts(prompts, c)
        meta = shard_metadata(final_state="pre_norm", chunk=c, layer_convention="hidden_states", model_hash="m0")
        if recorded is None or c in recorded:
            meta["prompts_sha256"] = sha256_file(prompts)
        shard = run / "shards" / f"chunk-{c:05d}.hss"
        with ShardWriter(shard, meta) as w:
            for k, row in enumerate(pq.read_table(prompts).to_pylist()):
                w.add(*make_sample(len(row["input_ids"]), seed=10 * c + k), sample_id=row["sample_id"])
        (run / "validation" / f"chunk-{c:05d}.json").write_text(json.dumps({"passed": True}))
        (run / "stats" / f"chunk-{c:05d}.json").write_text(json.dumps(chunk_stats(shard)))
    (run / "prompts" / "summary.json").write_text(json.dumps({"read": 2 * n_chunks}))
    save_token_freq(ChunkTotals([json.loads((run / "stats" / f"chunk-{c:05d}.json").read_text())
                                 for c in range(n_chunks)]).token_freq(), run / "token_freq.pt")
    return run


def manifest(run: Path, n_chunks: int, settings: Settings = SETTINGS) -> dict:
    """build_manifest as the workflow's manifest rule calls it."""
    names = [f"chunk-{c:05d}" for c in range(n_chunks)]
    return build_manifest(
        settings, shards=[run / "shards" / f"{n}.hss" for n in names],
        validation=[run / "validation" / f"{n}.json" for n in names],
        chunk_stats=[run / "stats" / f"{n}.json" for n in names],
        prompts=[run / "prompts" / f"{n}.parquet" for n in names],
        prepare_summary=run / "prompts" / "summary.json", token_freq=run / "token_freq.pt",
        out_path=run / "dataset.json")


def test_shards_made_from_the_prompts_there_pass(tmp_path: Path) -> None:
    run = make_run(tmp_path, 2)
    m = manifest(run, 2)
    assert m["all_valid"] is True and m["prompts_unchecked"] == []
    assert [e["prompts_sha256"] for e in m["shards"]] == [
        sha256_file(run / "prompts" / f"chunk-0000{c}.parquet") for c in (0, 1)]


@pytest.mark.parametrize("by", ["prepare", "damage"])
def test_prompts_changed_under_their_old_time_are_an_error_naming_the_chunk(tmp_path: Path, by: str) -> None:
    """Chunk 1's prompts changed, the file's modification time kept (Snakemake plans nothing). prepare's summary.json
    records each prompts file's sha256: rewritten by prepare (every input id, the record with them), the shard is
    stale; changed behind prepare's back (a bit flipped: the record still the shard's), the shard is good and the
    prompts file is to restore."""
    run = make_run(tmp_path, 2)
    prompts, shard = run / "prompts" / "chunk-00001.parquet", run / "shards" / "chunk-00001.hss"
    recorded, st = sha256_file(prompts), prompts.stat()
    if by == "prepare":
        write_prompts(prompts, 1, shift=1)
    else:
        (run / "prompts" / "summary.json").write_text(json.dumps({"read": 4, "per_chunk": [
            {"chunk": c, "sha256": sha256_file(run / "prompts" / f"chunk-0000{c}.parquet")} for c in (0, 1)]}))
        assert manifest(run, 2)["all_valid"] is True
        data = bytearray(prompts.read_bytes())
        data[len(data) // 2] ^= 1
        prompts.write_bytes(bytes(data))
    os.utime(prompts, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ValidationFailure) as e:
        manifest(run, 2)
    now = sha256_file(prompts)
    assert str(e.value) == (
        f"{shard}: chunk 1 was extracted from prompts of sha256 {recorded}, but {prompts} now has sha256 {now}: the "
        "prompts changed after the shard was written (and kept an older modification time, so Snakemake did not "
        "rerun the chunk). Delete the shard and rerun: only its chunk is extracted again." if by == "prepare" else
        f"{shard}: chunk 1 was extracted from prompts of sha256 {recorded}, which prepare wrote, but {prompts} now "
        f"has sha256 {now}: the prompts file was damaged or changed since, the shard is good. Restore {prompts} "
        "(`cp -p` from a copy); or delete it and run the same command, which writes every chunk's prompts again and "
        "extracts every chunk again.")


def test_a_shard_of_another_run_is_named_as_such(tmp_path: Path) -> None:
    run = make_run(tmp_path, 2)
    shard, prompts = run / "shards" / "chunk-00001.hss", run / "prompts" / "chunk-00001.parquet"
    meta = shard_metadata(final_state="pre_norm", chunk=1, layer_convention="hidden_states", model_hash="m0",
                          run_name="tiny-b", prompts_sha256="f" * 64)
    with ShardWriter(shard, meta) as w:
        w.add(*make_sample(4, seed=3), sample_id="b:0")
    with pytest.raises(ValidationFailure) as e:
        manifest(run, 2)
    assert str(e.value) == (
        f"{shard}: chunk 1 of run 'tiny-b', extracted from prompts of sha256 {'f' * 64}, but this run "
        f"'{SETTINGS.extract.run_name}' has {prompts} of sha256 {sha256_file(prompts)}: a shard copied from another "
        "run? Delete the shard and rerun: only its chunk is extracted again.")


def test_an_earlier_releases_shard_of_the_same_layers_passes_beside_a_new_one(tmp_path: Path) -> None:
    """Chunk 0 in layer-output ids (0, 1, 2: as an earlier release's shard, which recorded no convention, is read),
    chunk 1 extracted again now (hidden_states 1, 2, 3): the same layers. The manifest compared the ids as written
    and refused, and deleting the "odd" (new) shard as it advised made the same shard again (upgrade audit)."""
    run = make_run(tmp_path, 2, recorded=(1,))
    old = shard_metadata(final_state="pre_norm", chunk=0, aux_layers=[0, 1, 2], layer_convention="layer_output",
                         model_hash="m0")
    with ShardWriter(run / "shards" / "chunk-00000.hss", old) as w:
        for k in range(2):
            w.add(*make_sample(5, seed=k), sample_id=f"d:{k}")
    (run / "stats" / "chunk-00000.json").write_text(json.dumps(chunk_stats(run / "shards" / "chunk-00000.hss")))
    m = manifest(run, 2)
    assert m["all_valid"] is True and m["aux_layers"] == [1, 2, 3] and m["layer_convention"] == "hidden_states"


def test_a_shard_copied_over_another_chunks_is_named_as_such(tmp_path: Path) -> None:
    """`cp -p chunk-00000.hss chunk-00001.hss` (audit): said to be a changed prompts file before."""
    run = make_run(tmp_path, 2)
    shard = run / "shards" / "chunk-00001.hss"
    shutil.copy2(run / "shards" / "chunk-00000.hss", shard)
    with pytest.raises(ValidationFailure) as e:
        manifest(run, 2)
    assert str(e.value) == (f"{shard}: holds chunk 0 (its metadata says so) under chunk 1's name: a shard copied or "
                            "renamed over another. Delete it and rerun: only chunk 1 is extracted again.")


def test_a_shard_written_before_prompts_were_recorded_is_accepted_and_listed(tmp_path: Path, capsys) -> None:
    """A shard without `prompts_sha256` (an earlier release's) passes, uncompared: dataset.json and a warning say so;
    the shards that record it are still compared."""
    run = make_run(tmp_path, 3, recorded=(1, 2))
    write_prompts(run / "prompts" / "chunk-00000.parquet", 0, shift=1)  # cannot be told: not recorded
    m = manifest(run, 3)
    assert m["all_valid"] is True and m["prompts_unchecked"] == [0]
    assert [e["prompts_sha256"] is None for e in m["shards"]] == [True, False, False]
    assert capsys.readouterr().err == (
        "WARNING: the shards of chunks [0] were written before shards recorded the sha256 of their prompts: not "
        "compared with the prompts files (dataset.json: prompts_unchecked); delete them and rerun to have them "
        "checked\n")
    write_prompts(run / "prompts" / "chunk-00002.parquet", 2, shift=1)
    with pytest.raises(ValidationFailure, match=r"chunk-00002.hss: chunk 2 was extracted from prompts of sha256"):
        manifest(run, 3)


def test_fewer_chunks_than_before_removes_the_earlier_chunks_files(tmp_path: Path, capsys) -> None:
    """A run folder of 3 chunks whose configuration now makes 1: the manifest step removes chunks 1 and 2's
    prompts, shards, validation reports, statistics and regenerated chunks (one line each) and nothing else; the
    shard folder then reads as the current chunk alone."""
    run = make_run(tmp_path, 3)
    others = {"stats/chunks.tsv", "stats/summary.tsv", "prompts/summary.json", "token_freq.pt",
              "shards/chunk-00001.hss.bak", "validation/notes.json"}
    (run / "regenerated" / "chunks").mkdir(parents=True)
    for c in range(3):  # a run with regeneration: its chunk files too
        for suffix in (".jsonl", ".stats.json"):
            (run / "regenerated" / "chunks" / f"chunk-0000{c}{suffix}").write_text("x")
    others |= {"regenerated/chunks/chunk-00000.jsonl", "regenerated/chunks/chunk-00000.stats.json"}
    for name in others - {"prompts/summary.json", "token_freq.pt"}:
        (run / name).write_text("x")
    before = len(open_dataset(run / "shards"))
    removed = remove_stale_chunks(run, 1)
    gone = [f"{folder}/chunk-0000{c}{suffix}" for folder, suffix in (
        ("prompts", ".parquet"), ("shards", ".hss"), ("validation", ".json"), ("stats", ".json"),
        ("regenerated/chunks", ".jsonl"), ("regenerated/chunks", ".stats.json")) for c in (1, 2)]
    assert removed == [run / g for g in gone]
    assert capsys.readouterr().out.splitlines() == [
        f"removed {run / g}: chunk {int(g.split('chunk-')[1][:5])} of an earlier configuration (now 1 chunks)"
        for g in gone]
    left = {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()}
    assert left == others | {f"{folder}/chunk-00000{suffix}" for folder, suffix in (
        ("prompts", ".parquet"), ("shards", ".hss"), ("validation", ".json"), ("stats", ".json"))}
    assert (before, len(open_dataset(run / "shards"))) == (6, 2)
    assert manifest(run, 1)["counts"]["samples"] == 2


@pytest.mark.parametrize(("key", "config", "shard_value", "said"), [
    ("final_state", {"final_state": "post_norm"}, "pre_norm", "final_state: 'post_norm'"),
    ("precision", {"shard": {"precision": "fp8_e4m3"}}, "bf16", "shard.precision: 'fp8_e4m3'"),
    ("dtype", {"transformers": {"dtype": "float32"}}, "bfloat16", "transformers.dtype: 'float32'"),
    ("engine", {"engine": "sglang"}, "transformers", "engine: 'sglang'"),
])
def test_a_shard_the_config_did_not_make_is_refused_naming_the_key(tmp_path: Path, key: str, config: dict,
                                                                   shard_value: str, said: str) -> None:
    """`snakemake --touch` after a config change marks the old shards up to date; dataset.json records the config's
    values, so the manifest held them against the shards' and wrote the config's over data that is not (audit:
    final_state post_norm recorded over pre-norm shards)."""
    run = make_run(tmp_path, 2)
    with pytest.raises(ValidationFailure) as e:
        manifest(run, 2, from_config({**SETTINGS.config, **config}))
    assert str(e.value) == (
        f"{run / 'shards' / 'chunk-00000.hss'}: was written with {key} {shard_value!r}, but this run's config says "
        f"{said}; a shard of another configuration (marked up to date by `snakemake --touch`?). Delete it and rerun "
        "its chunk.")
    assert not (run / "dataset.json").exists()
