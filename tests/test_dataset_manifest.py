"""A run folder is read through its dataset.json: a missing or changed shard is an error naming it."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import finish_run, make_sample, shard_metadata

from hsextract import open_dataset
from hsextract.errors import ShardError
from hsextract.export import export
from hsextract.shard import ShardReader, ShardWriter


@pytest.fixture
def run(tmp_path):
    """A run folder with three one-sample shards and the dataset.json that lists them."""
    run = tmp_path / "run"
    (run / "shards").mkdir(parents=True)
    for chunk in range(3):
        path = run / "shards" / f"chunk-{chunk:05d}.hss"
        with ShardWriter(path, shard_metadata(final_state="pre_norm", chunk=chunk)) as w:
            w.add(*make_sample(5 + chunk, seed=chunk), sample_id=f"id{chunk}")
    return finish_run(run)


def test_reads_every_listed_shard(run):
    assert len(open_dataset(run)) == 3
    assert len(open_dataset(run / "dataset.json")) == 3  # its manifest names the run folder


def test_a_list_reads_runs_folders_and_shards_together(run, tmp_path):
    """Runs made apart (a dataset grown by a run of its own per increment) read as one; a shard in two of them is
    refused as in one list."""
    more = tmp_path / "more"
    (more / "shards").mkdir(parents=True)
    meta = shard_metadata(run_name="more", chunk=0, final_state="pre_norm")
    with ShardWriter(more / "shards" / "chunk-00000.hss", meta) as w:
        for k in range(2):
            w.add(*make_sample(4 + k, seed=10 + k), sample_id=f"more{k}")
    finish_run(more)
    ds = open_dataset([run, more])
    assert len(ds) == 5 and [ds[i]["input_ids"].shape[0] for i in range(5)] == [5, 6, 7, 4, 5]
    assert len(open_dataset([run / "shards", more / "shards" / "chunk-00000.hss"])) == 5
    with pytest.raises(ShardError, match=r"^the list of shards names .*chunk-00000.hss twice"):
        open_dataset([run, run / "shards" / "chunk-00000.hss"])
    with pytest.raises(ShardError, match="no such shard, run folder or shard folder"):
        open_dataset([run, tmp_path / "absent.hss"])
    assert len(open_dataset(iter([run, more]))) == 5  # any iterable
    with pytest.raises(ShardError, match="^open_dataset was given an empty list of shards$"):
        open_dataset(iter([]))
    # a chunk whose records were all dropped, in each run: the same (empty) prompts, no sample held twice
    for folder in (run, more):
        meta = shard_metadata(run_name=folder.name, chunk=9, final_state="pre_norm", prompts_sha256="e" * 64)
        with ShardWriter(folder / "empty.hss", meta):
            pass
    assert len(open_dataset([run, more, run / "empty.hss", more / "empty.hss"])) == 5


def test_a_shard_named_twice_is_refused_not_read_twice(run):
    one = run / "shards" / "chunk-00001.hss"
    with pytest.raises(ShardError) as e:
        open_dataset([one, run / "shards" / ".." / "shards" / one.name])  # another spelling of the same file
    assert str(e.value) == (f"the list of shards names {one.resolve()} twice (as {one} and "
                            f"{run / 'shards' / '..' / 'shards' / one.name}): a dataset holds each shard once")
    manifest = json.loads((run / "dataset.json").read_text())
    manifest["shards"].append(manifest["shards"][1])
    (run / "dataset.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError) as e:
        open_dataset(run)
    assert str(e.value) == (f"{run / 'dataset.json'} names {one.resolve()} twice (as {one} and {one}): a dataset "
                            "holds each shard once")


def test_a_later_run_under_way_is_told_from_damage(run, capsys):
    """A later run (another config) killed part way: prepare rewrote the prompts, some chunks were extracted again,
    dataset.json is the earlier run's. Deleting the "changed" shards, the advice for damage, would throw away the
    later run's finished chunks."""
    manifest = json.loads((run / "dataset.json").read_text())
    for c, e in enumerate(manifest["shards"]):  # as the workflow's manifest records them
        e["chunk"], e["prompts_sha256"] = c, str(c) * 64
    (run / "dataset.json").write_text(json.dumps(manifest))
    (run / "prompts").mkdir()
    summary = {"per_chunk": [{"chunk": c, "sha256": e["prompts_sha256"]} for c, e in enumerate(manifest["shards"])]}
    summary["per_chunk"][2]["sha256"] = "0" * 64  # chunk 2's prompts rewritten, and its shard extracted again
    (run / "prompts" / "summary.json").write_text(json.dumps(summary))
    again = run / "shards" / "chunk-00002.hss"
    with ShardWriter(again, shard_metadata(final_state="pre_norm", chunk=2)) as w:
        w.add(*make_sample(9, seed=5), sample_id="id2")
    with pytest.raises(ShardError) as e:
        open_dataset(run)
    assert str(e.value) == (
        f"{again}: {again.stat().st_size} bytes, {run / 'dataset.json'} records {manifest['shards'][2]['bytes']}. "
        f"{run} is part way through a later run: prepare rewrote the prompts of chunk 2 after {run / 'dataset.json'}"
        " was written, and that run extracts every chunk again. Finish it (its command and config file: "
        "dataset.json is written again once every chunk is done); deleting shards would throw away chunks it "
        "already extracted")
    assert len(open_dataset(run, allow_missing=True)) == 2
    assert capsys.readouterr().err.endswith("that run extracts every chunk again: the shards read may be either "
                                            "run's\n")
    # the same prompts, or a summary.json that is not prepare's (hand-edited, hostile): damage, as before
    for text in (json.dumps({"per_chunk": [{"chunk": 2, "sha256": manifest["shards"][2]["prompts_sha256"]}]}),
                 json.dumps({"per_chunk": [{"chunk": 2, "sha256": ["0" * 64]}]}),
                 json.dumps({"per_chunk": [3]}), "[" * 100_000 + "]" * 100_000):
        (run / "prompts" / "summary.json").write_text(text)
        with pytest.raises(ShardError, match=f"Delete {again}, then rerun the workflow"):
            open_dataset(run)


def test_deleted_shard_is_an_error_naming_it(run):
    gone = run / "shards" / "chunk-00001.hss"
    gone.unlink()
    with pytest.raises(ShardError) as e:
        open_dataset(run)
    assert f"{gone}: listed in {run / 'dataset.json'} but missing" in str(e.value)
    assert "only these chunks are extracted again" in str(e.value)


def test_the_missing_shard_message_names_the_cli_option_too(run, tmp_path, capsys):
    from hsextract.cli import main

    gone = run / "shards" / "chunk-00001.hss"
    gone.unlink()
    out = tmp_path / "out"
    assert main(["export", "--format", "speculators-v1", str(run), str(out)]) == 2
    assert capsys.readouterr().err == (
        f"hsextract export: error: {gone}: listed in {run / 'dataset.json'} but missing. Rerun the workflow "
        "(`snakemake --cores N`): only these chunks are extracted again; in a copy of a run folder, copy the files "
        "named here again from the original instead; or, to read the other shards, pass allow_missing=True "
        "(hsextract export: --allow-missing)\n")
    assert not out.exists()
    assert main(["export", "--format", "speculators-v1", "--allow-missing", str(run), str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"exported 2 samples (12 tokens) as speculators-v1 to {out / 'data'}\n")
    from hsextract.export import export  # the summary says it too, not only the warning on stderr

    assert export(run, tmp_path / "again", "speculators-v1", allow_missing=True)["notes"] == [
        f"{run}: exported from 2 of the 3 shards its dataset.json lists (--allow-missing): the others' samples are "
        "not in this export"]


def test_a_run_s_shards_folder_is_read_through_its_dataset_json(run, capsys):
    """A partial copy of a run (rsync of shards/ cut short, a shard lost on the way): the shards folder named
    alone is the run's, and a shard missing from it an error, not a smaller dataset."""
    gone = run / "shards" / "chunk-00001.hss"
    gone.unlink()
    for path in (run / "shards", str(run / "shards") + "/"):
        with pytest.raises(ShardError) as e:
            open_dataset(path)
        assert str(e.value).startswith(f"{gone}: listed in {run / 'dataset.json'} but missing. Rerun the workflow")
    assert len(open_dataset(run / "shards", allow_missing=True)) == 2
    assert "WARNING: reading 2 of 3 shards" in capsys.readouterr().err
    assert len(open_dataset([run / "shards" / "chunk-00000.hss", run / "shards" / "chunk-00002.hss"])) == 2
    # and the export's summary counts against that manifest too
    assert export(run / "shards", run.parent / "out", "speculators-v1", allow_missing=True)["notes"] == [
        f"{run / 'shards'}: exported from 2 of the 3 shards its dataset.json lists (--allow-missing): the others' "
        "samples are not in this export"]


def test_allow_missing_reads_the_rest_with_a_warning(run, capsys):
    (run / "shards" / "chunk-00001.hss").unlink()
    ds = open_dataset(run, allow_missing=True)
    assert [ds[i]["input_ids"].shape[0] for i in range(len(ds))] == [5, 7]
    assert "WARNING: reading 2 of 3 shards" in capsys.readouterr().err


def test_truncated_shard_is_an_error(run):
    path = run / "shards" / "chunk-00002.hss"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(ShardError) as e:
        open_dataset(run)
    # a rerun alone would not redo it (the file is there): the advice says to delete it first
    assert str(e.value) == (f"{path}: {size - 10} bytes, {run / 'dataset.json'} records {size}. Delete {path}, then "
                            "rerun the workflow (`snakemake --cores N`): only these chunks are extracted again; in a "
                            "copy of a run folder, copy the files named here again from the original instead; or, to "
                            "read the other shards, pass allow_missing=True (hsextract export: --allow-missing)")


def test_export_compares_checksums(run, tmp_path):
    path = run / "shards" / "chunk-00000.hss"
    off = ShardReader(path).index["offsets"][0]
    data = bytearray(path.read_bytes())
    data[off + 32] ^= 0xFF  # inside the first sample record: same size, other bytes
    path.write_bytes(bytes(data))
    assert len(open_dataset(run)) == 3  # sizes agree: opening alone does not hash
    with pytest.raises(ShardError) as e:
        export(run, tmp_path / "out", "speculators-v1")
    assert str(e.value).startswith(f"{path}: sha256 differs from the one {run / 'dataset.json'} records. Delete "
                                   f"{path}, then rerun the workflow")


def test_data_hash_covers_every_byte_of_the_files_a_source_reads(tmp_path: Path) -> None:
    """A file's sha256; a save_to_disk split: over the Arrow files its reader reads, not the folder's other files."""
    from hsextract.config.settings import Source
    from hsextract.prepare.sources import data_files
    from hsextract.provenance import data_hash

    f = tmp_path / "a.jsonl"
    f.write_bytes(b'{"messages": []}\n')
    one = Source(str(f), "auto", 1.0, None, None, None)
    assert data_files(one) == [f] and data_hash([f]) == hashlib.sha256(f.read_bytes()).hexdigest()
    d = tmp_path / "ds"
    (d / "train").mkdir(parents=True)
    (d / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (d / "train/state.json").write_text('{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    arrow = d / "train/data-00000-of-00001.arrow"
    arrow.write_bytes(b"\x00" * 100)
    split = Source(str(d), "auto", 1.0, None, None, "train")
    assert data_files(split) == [arrow]
    before = data_hash(data_files(split))
    (d / ".lock").write_text("x")  # beside the data: not it
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    assert data_hash(data_files(Source(str(copy), "auto", 1.0, None, None, "train"))) == before
    arrow.write_bytes(b"\x00" * 99 + b"\x01")  # one byte, deep in the data
    assert data_hash(data_files(split)) != before


def test_shards_of_another_model_tokenizer_or_template_are_not_mixed(tmp_path):
    """open_dataset over a list or a folder (no dataset.json to say they are one run): shards whose model, tokenizer or
    chat template differ by content are refused, as the manifest refuses them in a run (they were read together,
    the first shard's hashes reported for all); the same model named by another path is read."""
    def shard(name: str, **meta) -> Path:
        path = tmp_path / name
        with ShardWriter(path, shard_metadata(**{"model_hash": "m0", **meta})) as w:
            w.add(*make_sample(5), sample_id=name)
        return path

    base = shard("a.hss")
    assert len(open_dataset([base, shard("b.hss", model="/abs/test-model")])) == 2  # another path, same content
    for key, value in (("model_hash", "m1"), ("tokenizer_hash", "t1"), ("chat_template_hash", "h1")):
        other = shard(f"{key}.hss", **{key: value})
        with pytest.raises(ShardError) as e:
            open_dataset([base, other])
        first = {"model_hash": "m0", "tokenizer_hash": "t0", "chat_template_hash": "h0"}[key]
        assert str(e.value) == (f"{other}: {key} = {value!r} (model 'test-model') but {base} has {first!r} (model "
                                "'test-model'); shards of one dataset must come from the same model, tokenizer and "
                                "chat template")
    # shards that record no model hash (written before it was): the model's path decides
    old = tmp_path / "old"
    old.mkdir()
    for name, model in (("a.hss", "m"), ("b.hss", "n")):
        with ShardWriter(old / name, shard_metadata(model=model)) as w:
            w.add(*make_sample(5), sample_id=name)
    with pytest.raises(ShardError, match=r"b\.hss: model = 'n' \(model 'n'\) but .*a\.hss has 'm'"):
        open_dataset(old)


def test_a_sample_index_is_an_integer(run):
    """numpy's and torch's integers index (a sampler's); "1", 1.5 and True did too, as int() took them."""
    import numpy as np
    import torch

    ds = open_dataset(run)
    assert torch.equal(ds[np.int64(1)]["input_ids"], ds[1]["input_ids"])
    assert torch.equal(ds[torch.tensor(2)]["input_ids"], ds[-1]["input_ids"])
    for bad in ("1", 1.5, True, None):
        with pytest.raises(TypeError) as e:
            ds[bad]
        assert str(e.value) == f"sample index must be an integer, not {type(bad).__name__} {bad!r}"


def test_a_run_folder_without_its_dataset_json_is_unfinished_and_refused(run):
    """No dataset.json (a run still going, or one whose chunk failed under keep-going): the shards present are not
    a dataset; reading them takes naming the shards folder."""
    (run / "dataset.json").unlink()
    (run / "shards" / "chunk-00001.hss").unlink()
    with pytest.raises(ShardError) as e:
        open_dataset(run)
    assert str(e.value) == (
        f"{run}: no dataset.json: the run has not finished (its manifest job writes it once every shard is valid), "
        f"so {run / 'shards'} may lack chunks. Finish the run (`snakemake --cores N`: only the missing chunks are "
        "extracted), or name that shards folder to read the shards present as they are")
    assert len(open_dataset(run / "shards")) == 2


@pytest.mark.parametrize("recorded", ["prompts_sha256", "run, chunk and ids"])
def test_a_copy_of_a_shard_beside_it_is_refused(tmp_path, recorded):
    """`chunk-00001 (copy).hss` in a shards folder: its samples would come twice an epoch. A shard is known by its
    prompts' sha256, or (written before shards recorded it) by its run, chunk and sample ids."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for chunk in range(2):
        extra = {"prompts_sha256": f"{chunk}" * 64} if recorded == "prompts_sha256" else {}
        with ShardWriter(folder / f"chunk-{chunk:05d}.hss",
                         shard_metadata(run_name="r", chunk=chunk, **extra)) as w:
            w.add(*make_sample(5, seed=chunk), sample_id="conversations:0")  # the same id: another chunk is no copy
    assert len(open_dataset(folder)) == 2
    shutil.copyfile(folder / "chunk-00001.hss", folder / "chunk-00001 (copy).hss")
    same = "made from the same prompts" if recorded == "prompts_sha256" else \
        "the same sample ids, both too old to record their prompts' sha256"
    with pytest.raises(ShardError) as e:
        open_dataset(folder)
    assert str(e.value) == (
        f"{folder / 'chunk-00001.hss'} and {folder / 'chunk-00001 (copy).hss'} hold the same samples (chunk 1 of run "
        f"'r', {same}): one is a copy of the other, and a dataset holds each sample once. Move the copy out of the "
        "shards, or name the shards to read")


@pytest.mark.parametrize("first", ["earlier release", "this release"])
def test_a_chunk_from_an_earlier_release_beside_its_new_copy_is_refused(tmp_path, first):
    """A shards folder kept from before the upgrade globbed with the new one (upgrade audit): the earlier shard
    records no prompts' sha256, the new one does; the two were keyed differently and both were read."""
    shards = []
    for k, extra in enumerate(({}, {"prompts_sha256": "1" * 64})):
        shards.append(tmp_path / f"{k}" / "chunk-00000.hss")
        shards[-1].parent.mkdir()
        with ShardWriter(shards[-1], shard_metadata(run_name="r", chunk=0, **extra)) as w:
            w.add(*make_sample(5, seed=0), sample_id="conversations:0")
    if first == "this release":
        shards.reverse()
    with pytest.raises(ShardError) as e:
        open_dataset(shards)
    assert str(e.value).startswith(f"{shards[1]} and {shards[0]} hold the same samples (chunk 0 of run 'r', the "
                                   "same sample ids; one too old to record its prompts' sha256): one is a copy")


@pytest.mark.parametrize("meta", [{"chunk": [0]}, {"run_name": ["r"]}, {"prompts_sha256": ["f" * 64]},
                                  {"run_name": 7, "prompts_sha256": None}])
def test_odd_identity_metadata_is_read_not_a_crash(tmp_path, meta):
    """A hand-made shard whose chunk, run or sha256 is a list: no copy can be told by it (a TypeError before);
    one whose run is a number still is."""
    shard = tmp_path / "chunk-00000.hss"
    with ShardWriter(shard, shard_metadata(**{"run_name": "r", "chunk": 0, "prompts_sha256": "1" * 64, **meta})) as w:
        w.add(*make_sample(5, seed=0), sample_id="conversations:0")
    assert len(open_dataset([shard])) == 1
    if meta.get("run_name") == 7:
        shutil.copyfile(shard, tmp_path / "copy.hss")
        with pytest.raises(ShardError, match="hold the same samples"):
            open_dataset([shard, tmp_path / "copy.hss"])


@pytest.mark.parametrize("path", ["/etc/hostname", "../elsewhere/chunk-00000.hss", "shards/../../x.hss"])
def test_a_dataset_json_naming_a_file_outside_its_folder_is_refused(run, path):
    """A shared dataset.json may not point the reader at files beside or above the dataset it describes."""
    manifest = json.loads((run / "dataset.json").read_text())
    manifest["shards"][1]["path"] = path
    (run / "dataset.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError) as e:
        open_dataset(run)
    assert str(e.value) == (f"{run / 'dataset.json'}: shards[1].path {path!r} is not a path inside the run folder "
                            "(dataset.json lists its shards relative to it); delete it and run the workflow's "
                            "command again, which writes it again")


def test_a_damaged_dataset_json_or_a_folder_in_a_shards_place_says_what_to_delete(run):
    """A dataset.json cut short: Snakemake sees nothing to redo while it is there, so the advice is to delete it. A
    folder where a shard was is no missing shard (the rules fail on it; nothing reruns until it goes)."""
    good = (run / "dataset.json").read_text()
    (run / "dataset.json").write_text(good[: len(good) // 2])
    with pytest.raises(ShardError) as e:
        open_dataset(run)
    assert str(e.value).startswith(f"{run / 'dataset.json'}: not a readable hsextract dataset.json (JSONDecodeError: ")
    assert str(e.value).endswith("; delete it and run the workflow's command again, which writes it again (no chunk "
                                 "is extracted again); in a copy of a run folder, copy the files named here again from "
                                 "the original instead")
    (run / "dataset.json").write_text(good)
    shard = run / json.loads(good)["shards"][1]["path"]
    shard.unlink()
    shard.mkdir()
    with pytest.raises(ShardError) as e:
        open_dataset(run)
    assert str(e.value) == (
        f"{shard}: listed in {run / 'dataset.json'} but not a regular file. Delete {shard}, then rerun the workflow "
        "(`snakemake --cores N`): only these chunks are extracted again; in a copy of a run folder, copy the files "
        "named here again from the original instead; or, to read the other shards, pass allow_missing=True "
        "(hsextract export: --allow-missing)")


def test_a_symlink_loop_in_a_list_is_refused_as_no_shard(tmp_path):
    (tmp_path / "a.hss").symlink_to("b.hss")
    (tmp_path / "b.hss").symlink_to("a.hss")
    with pytest.raises(ShardError, match="no such shard"):
        open_dataset([tmp_path])
