"""Exports: each consumer's loader reads our files unchanged and gets our tensors back."""

import importlib
import importlib.util
import json
import os
import shutil
import sys
import types
import warnings
from collections import Counter

import pytest
import torch
from conftest import finish_run, make_sample, shard_metadata

from hsextract import open_dataset
from hsextract.errors import ConfigError, CorruptShardError, ShardError
from hsextract.export import FinalNormWarning, export
from hsextract.export.specforge import group_dir
from hsextract.shard import ShardReader, ShardWriter


def bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.fixture
def run_dir(tmp_path):
    """A run folder with two shards (3 + 2 samples of varied length), final_state pre_norm."""
    shards = tmp_path / "run" / "shards"
    shards.mkdir(parents=True)
    k = 0
    for chunk, n in enumerate((3, 2)):
        with ShardWriter(shards / f"chunk-{chunk:05d}.hss", shard_metadata(final_state="pre_norm", chunk=chunk)) as w:
            for _ in range(n):
                w.add(*make_sample(4 + 3 * k, seed=k), sample_id=f"id{k}")
                k += 1
    return finish_run(tmp_path / "run")


def expected_freq(ds):
    c = Counter()
    for s in ds:
        c.update(s["input_ids"][s["loss_mask"] == 1].tolist())
    return dict(c)


def import_eagle3_dataset():
    """speculators 0.4.0's Eagle3SampleFileDataset, imported from its own file.

    Shim: `import speculators` runs the package __init__, which imports speculators.models and needs
    transformers <= 4.57 (transformers.modeling_attn_mask_utils is gone in 5.x). train/data.py itself needs
    only torch and speculators.train.noise_transforms, so the two package modules are stubbed with their real
    __path__ and train/data.py is imported unchanged.
    """
    spec = importlib.util.find_spec("speculators")
    if spec is None:
        pytest.skip("speculators==0.4.0 not installed (pip install --no-deps speculators==0.4.0)")
    from importlib.metadata import version

    assert version("speculators") == "0.4.0"
    saved = {k: v for k, v in sys.modules.items() if k == "speculators" or k.startswith("speculators.")}
    try:
        root = types.ModuleType("speculators")
        root.__path__ = list(spec.submodule_search_locations)
        train = types.ModuleType("speculators.train")
        train.__path__ = [p + "/train" for p in root.__path__]
        sys.modules.update({"speculators": root, "speculators.train": train})
        return importlib.import_module("speculators.train.data")
    finally:
        for k in [k for k in sys.modules if k == "speculators" or k.startswith("speculators.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_speculators_v1_loads_in_eagle3_sample_file_dataset(run_dir, tmp_path):
    data_mod = import_eagle3_dataset()
    out = tmp_path / "v1"
    summary = export(run_dir, out, "speculators-v1")
    ds = open_dataset(run_dir)
    assert summary["num_samples"] == 5 and summary["warning"] is None
    data = out / "data"
    assert sorted(p.name for p in data.iterdir()) == sorted(
        [f"data_{i}.pt" for i in range(5)] + ["sample_lengths.json", "data_config.json"])
    assert json.loads((data / "sample_lengths.json").read_text()) == {str(i): 4 + 3 * i for i in range(5)}
    cfg = json.loads((data / "data_config.json").read_text())
    assert list(cfg)[:10] == ["version", "generated_at", "speculators_version", "reproducibility", "model", "data",
                              "hidden_states", "generation", "format", "hsextract"]
    assert cfg["version"] == "2.0" and cfg["model"]["hidden_size"] == 16 and cfg["data"]["num_samples"] == 5
    assert cfg["format"]["file_pattern"] == "data_{idx}.pt"
    assert cfg["reproducibility"]["package_versions"]["transformers"] is None  # engine_version "test" names none
    assert cfg["format"]["schema"]["hidden_states"]["num_tensors"] == 4
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    assert type(freq) is dict and all(type(k) is int and type(v) is int for k, v in freq.items())
    assert freq == expected_freq(ds)

    for i in range(5):
        raw = torch.load(data / f"data_{i}.pt", weights_only=True)
        ours = ds[i]
        assert list(raw) == ["input_ids", "hidden_states", "loss_mask"] and isinstance(raw["hidden_states"], list)
        assert torch.equal(raw["input_ids"], ours["input_ids"]) and torch.equal(raw["loss_mask"], ours["loss_mask"])
        for a, b in zip(raw["hidden_states"], ours["hidden_states"], strict=True):
            assert a.dtype == torch.bfloat16 and torch.equal(bits(a), bits(b))

    sds = data_mod.Eagle3SampleFileDataset(max_len=64, datapath=str(data))
    assert len(sds) == 5
    by_idx = {int(str(p).rsplit("_", 1)[1][:-3]): k for k, p in enumerate(sds.data)}
    assert [sds.approx_lengths[by_idx[i]] for i in range(5)] == [4 + 3 * i for i in range(5)]
    for i in range(5):
        got, ours = sds[by_idx[i]], ds[i]
        hs = ours["hidden_states"]
        assert torch.equal(got["input_ids"], ours["input_ids"][1:])
        assert torch.equal(got["loss_mask"], ours["loss_mask"][1:])
        assert torch.equal(got["hidden_states"], torch.cat(hs[:-1], dim=-1)[:-1].float())
        assert torch.equal(got["verifier_last_hidden_states"], hs[-1][1:].float())
        assert got["hidden_states"].shape == (3 + 3 * i, 48)


def test_specforge_keys_shapes_values(run_dir, tmp_path):
    out = tmp_path / "sf"
    with pytest.warns(FinalNormWarning):
        export(run_dir, out, "specforge")
    ds = open_dataset(run_dir)
    assert sorted(p.name for p in out.iterdir()) == ["layers.json", "rows_0-2000"]  # SpecForge reads rows_*/*.ckpt
    for i in range(5):
        d = torch.load(out / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        ours = ds[i]
        seq = 4 + 3 * i
        assert list(d) == ["input_ids", "loss_mask", "hidden_state", "aux_hidden_state"]
        assert d["input_ids"].dtype == torch.int64 and torch.equal(d["input_ids"], ours["input_ids"])
        assert torch.equal(d["loss_mask"], ours["loss_mask"])
        assert d["hidden_state"].shape == (1, seq, 16) and d["aux_hidden_state"].shape == (1, seq, 48)
        assert torch.equal(bits(d["hidden_state"][0]), bits(ours["hidden_states"][3]))
        for k in range(3):
            assert torch.equal(bits(d["aux_hidden_state"][0, :, 16 * k:16 * (k + 1)]), bits(ours["hidden_states"][k]))


@pytest.mark.parametrize("fmt,trainer", [("specforge", "SpecForge 0.2.0's"), ("speculators-v1", "speculators 0.4.0's"),
                                         ("speculators-safetensors", "speculators'")])
@pytest.mark.filterwarnings("ignore::hsextract.export.FinalNormWarning")
def test_each_trainer_is_told_of_an_aux_layer_count_its_model_does_not_take(tmp_path, capsys, fmt, trainer):
    """SpecForge 0.2.0's and speculators' EAGLE-3 draft models take exactly 3 aux layers (SpecForge's read in its
    model_providers.py; speculators 0.4.0's fc is Linear(3 x hidden, hidden)): an export of another count says so
    (a note: the data is exported all the same)."""
    shards = tmp_path / "run" / "shards"
    shards.mkdir(parents=True)
    with ShardWriter(shards / "chunk-00000.hss", shard_metadata(aux_layers=[1, 2], final_state="post_norm")) as w:
        w.add(*make_sample(5, n=3), sample_id="a")
    run = finish_run(tmp_path / "run")
    note = f"{run} holds 2 aux layers, and {trainer} EAGLE-3 draft model takes exactly 3 (its trainer would fail " \
           "on this data); capture: eagle3 stores 3"
    assert export(run, tmp_path / "out", fmt)["notes"] == [note]
    assert f"WARNING: export {fmt}: {note}" in capsys.readouterr().err.splitlines()  # beside a post-norm warning


def test_specforge_group_folders():
    """SpecForge's names: rows_{g}-{g + 2000}, the last folder's too (it wrote rows_4000-4500 for 4,500 samples)."""
    assert group_dir(0) == group_dir(1999) == "rows_0-2000"
    assert group_dir(2000) == "rows_2000-4000"
    assert group_dir(4499) == "rows_4000-6000"


def test_speculators_safetensors_values(run_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    from safetensors.torch import load_file

    out = tmp_path / "st"
    export(run_dir, out, "speculators-safetensors")
    ds = open_dataset(run_dir)
    table = datasets.load_from_disk(str(out))
    assert len(table) == 5 and list(table.with_format(None)["seq_len"]) == [4 + 3 * i for i in range(5)]
    for i in range(5):
        ours = ds[i]
        hs = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        assert sorted(hs) == ["hidden_states", "token_ids"]
        assert hs["hidden_states"].shape == (4 + 3 * i, 4, 16) and hs["hidden_states"].dtype == torch.bfloat16
        for k in range(4):
            assert torch.equal(bits(hs["hidden_states"][:, k]), bits(ours["hidden_states"][k]))
        # speculators >=0.5 ArrowDataset requires exactly this, then joins loss_mask by row
        assert torch.equal(hs["token_ids"], table[i]["input_ids"])
        assert torch.equal(table[i]["input_ids"], ours["input_ids"])
        assert torch.equal(table[i]["loss_mask"], ours["loss_mask"])
    assert torch.load(out / "token_freq.pt", weights_only=True) == expected_freq(ds)


@pytest.mark.parametrize("final_state", ["pre_norm", "post_norm"])
@pytest.mark.parametrize("fmt,wants", [("speculators-v1", "pre_norm"), ("speculators-safetensors", "pre_norm"),
                                       ("specforge", "post_norm")])
def test_final_norm_warning_fires_exactly_on_mismatch(tmp_path, capsys, final_state, fmt, wants):
    shards = tmp_path / "shards"
    shards.mkdir()
    with ShardWriter(shards / "c.hss", shard_metadata(final_state=final_state)) as w:
        w.add(*make_sample(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = export(shards, tmp_path / "out", fmt)
    err = capsys.readouterr().err
    norm = [w for w in caught if issubclass(w.category, FinalNormWarning)]
    if final_state == wants:
        assert norm == [] and err == "" and summary["warning"] is None
    else:
        assert len(norm) == 1 and str(norm[0].message) == summary["warning"] and err == summary["warning"] + "\n"
        assert f"expects final_state={wants}" in err and f"captured with final_state={final_state}" in err
        assert ("applied TWICE" in err) if wants == "pre_norm" else ("MISS the final RMSNorm" in err)


def tree(folder):
    """Every path under folder: a file's bytes, a folder's None."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def damage_last_sample(run_dir):
    path = run_dir / "shards" / "chunk-00001.hss"
    off = ShardReader(path).index["offsets"][1]
    data = bytearray(path.read_bytes())
    data[off + 40] ^= 0xFF  # the payload of sample 1 of the second shard: export fails after 4 of 5 samples
    path.write_bytes(bytes(data))
    return path


def test_non_empty_out_dir_needs_force_and_the_old_export_is_replaced_whole(run_dir, tmp_path):
    out = tmp_path / "v1"
    (out / "data").mkdir(parents=True)
    (out / "data" / "data_7.pt").write_bytes(b"old")
    with pytest.raises(ConfigError) as e:
        export(run_dir, out, "speculators-v1")
    assert str(e.value) == (f"{out}: folder is not empty; export into an empty folder, or pass --force to replace "
                            "the export in it")
    assert tree(out) == {"data": None, "data/data_7.pt": b"old"}
    summary = export(run_dir, out, "speculators-v1", force=True)
    assert summary["data_path"] == str(out / "data") and summary["token_freq_path"] == str(out / "token_freq.pt")
    assert sorted(tree(out)) == ["data", *[f"data/data_{i}.pt" for i in range(5)], "data/data_config.json",
                                 "data/sample_lengths.json", "layers.json", "token_freq.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "v1"]  # no temporary folder left


def test_force_refuses_a_folder_holding_more_than_an_export(run_dir, tmp_path):
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "layers.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        export(run_dir, out, "specforge", force=True)
    assert str(e.value) == (f"{out}: holds notes.txt, which no export writes; --force replaces an earlier export "
                            "whole, so move those out first or export into another folder")
    assert tree(out) == {"notes.txt": b"mine", "layers.json": b"{}"}


def test_force_refuses_foreign_files_inside_an_exports_folders(run_dir, tmp_path):
    out = tmp_path / "home"
    (out / "data").mkdir(parents=True)
    (out / "data" / "data_0.pt").write_bytes(b"old")
    (out / "data" / "thesis.tex").write_text("mine")
    (out / "rows_0-2000").write_text("a file where an export writes a folder")
    with pytest.raises(ConfigError) as e:
        export(run_dir, out, "specforge", force=True)
    assert str(e.value) == (f"{out}: holds data/thesis.tex, rows_0-2000, which no export writes; --force replaces an "
                            "earlier export whole, so move those out first or export into another folder")
    assert tree(out) == {"data": None, "data/data_0.pt": b"old", "data/thesis.tex": b"mine",
                         "rows_0-2000": b"a file where an export writes a folder"}


@pytest.mark.parametrize("where", ["the run", "above the run", "the shards"])
def test_an_out_dir_holding_what_the_export_reads_is_refused(run_dir, tmp_path, where):
    """`export data/ .` with the shards in `./data`: --force would replace the folder that holds them."""
    out, held = {"the run": (run_dir, run_dir), "above the run": (tmp_path, run_dir),
                 "the shards": (run_dir / "shards", run_dir / "shards" / "chunk-00000.hss")}[where]
    before = tree(tmp_path)
    with pytest.raises(ConfigError) as e:
        export(run_dir, out, "specforge", force=True)
    assert str(e.value) == (f"{out}: holds {held}, which this export reads (an export replaces its folder whole); "
                            f"export into a folder outside {run_dir}")
    assert tree(tmp_path) == before


def test_a_shards_folder_named_like_an_export_folder_is_never_replaced(tmp_path):
    """The audit's case: shards copied into exp/data, then `export exp/data exp --force`."""
    data = tmp_path / "exp" / "data"
    data.mkdir(parents=True)
    with ShardWriter(data / "chunk-00000.hss", shard_metadata(final_state="pre_norm")) as w:
        w.add(*make_sample(5, seed=0), sample_id="a")
    before = tree(tmp_path)
    with pytest.raises(ConfigError, match="which this export reads"):
        export(data, tmp_path / "exp", "specforge", force=True)
    assert tree(tmp_path) == before


def test_an_export_through_a_link_lands_in_its_target_and_a_killed_ones_folder_goes(run_dir, tmp_path):
    """OUT_DIR a symlink (to a big disk, say): the export is built beside the target and replaces it, the link
    stays. A killed export's temporary folder (no `finally` ran) is removed by the next export of that folder."""
    big = tmp_path / "big"
    big.mkdir()
    (tmp_path / "out").symlink_to(big / "v1")
    killed = big / ".v1.0123456789abcdef.tmp"
    (killed / "data").mkdir(parents=True)
    (killed / "data" / "data_0.pt").write_bytes(b"half")
    export(run_dir, tmp_path / "out", "speculators-v1")
    assert (tmp_path / "out").is_symlink() and sorted(p.name for p in big.iterdir()) == ["v1"]
    assert "data/data_config.json" in tree(big / "v1")


@pytest.mark.filterwarnings("ignore::hsextract.export.FinalNormWarning")
@pytest.mark.parametrize("fmt", ["speculators-v1", "specforge", "speculators-safetensors"])
def test_a_failed_export_leaves_no_output_and_the_earlier_export_as_it_was(run_dir, tmp_path, fmt):
    earlier = tmp_path / "earlier"
    export(run_dir, earlier, fmt)
    before = tree(earlier)
    assert len(before) > 5
    path = damage_last_sample(run_dir)
    # a folder of the shards outside a run: no dataset.json whose checksums would refuse the damaged shard first
    shards = run_dir / "loose"
    shutil.copytree(run_dir / "shards", shards)
    want = (f"{shards / path.name}: sample 1: checksum mismatch. The shard is damaged: delete it and rerun its chunk "
            "(snakemake reruns a missing shard).")
    with pytest.raises(CorruptShardError) as e:
        export(shards, tmp_path / "fresh", fmt)
    assert str(e.value) == want
    with pytest.raises(CorruptShardError) as e:
        export(shards, earlier, fmt, force=True)
    assert str(e.value) == want
    assert tree(earlier) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier", "run"]  # no fresh/, no temporary folder


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_is_refused_as_not_a_regular_file(tmp_path, capsys):
    from hsextract.cli import main

    fifo = tmp_path / "pipe.hss"
    os.mkfifo(fifo)
    want = f"{fifo}: not a regular file; a shard is a regular *.hss file"
    with pytest.raises(ShardError) as e:
        open_dataset(fifo)
    assert str(e.value) == want
    assert main(["export", "--format", "specforge", str(fifo), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"hsextract export: error: {want}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.hss"]


def test_unknown_format_is_refused(run_dir, tmp_path):
    with pytest.raises(ConfigError,
                       match="export format 'eagle': use one of speculators-v1, specforge, speculators-safetensors"):
        export(run_dir, tmp_path / "o", "eagle")


def test_five_aux_layer_capture_round_trips_and_exports(tmp_path):
    """capture: dflash (5 aux layers + final = 6 tensors): shard round trip byte-exact, every format keeps all."""
    aux = [1, 2, 4, 6, 7]
    shards = tmp_path / "run" / "shards"
    shards.mkdir(parents=True)
    samples = [make_sample(5 + i, n=6, seed=i) for i in range(3)]
    with ShardWriter(shards / "chunk-00000.hss", shard_metadata(final_state="pre_norm", aux_layers=aux)) as w:
        for i, s in enumerate(samples):
            w.add(*s, sample_id=f"id{i}")
    ds = open_dataset(finish_run(tmp_path / "run"))
    assert ds.metadata["aux_layers"] == aux and ds.metadata["num_hidden_tensors"] == 6
    for (ids, hs, mask), got in zip(samples, ds, strict=True):
        assert torch.equal(got["input_ids"], ids) and torch.equal(got["loss_mask"], mask)
        assert len(got["hidden_states"]) == 6
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got["hidden_states"], hs, strict=True))

    export(tmp_path / "run", tmp_path / "v1", "speculators-v1")
    cfg = json.loads((tmp_path / "v1" / "data" / "data_config.json").read_text())
    assert cfg["format"]["schema"]["hidden_states"]["num_tensors"] == 6
    assert cfg["hidden_states"]["layer_ids"][:5] == [a - 1 for a in aux]  # speculators 0.4: layer outputs
    raw = torch.load(tmp_path / "v1" / "data" / "data_2.pt", weights_only=True)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(raw["hidden_states"], samples[2][1], strict=True))
    with pytest.warns(FinalNormWarning):  # pre_norm without a recorded norm: exported as is, loudly
        export(tmp_path / "run", tmp_path / "sf", "specforge")
    d = torch.load(tmp_path / "sf" / "rows_0-2000" / "data_1.ckpt", weights_only=True)
    assert d["aux_hidden_state"].shape == (1, 6, 5 * 16)
    assert torch.equal(bits(d["aux_hidden_state"][0]), bits(torch.cat(samples[1][1][:5], dim=-1)))
    assert torch.equal(bits(d["hidden_state"][0]), bits(samples[1][1][5]))

    data_mod = import_eagle3_dataset()
    sds = data_mod.Eagle3SampleFileDataset(max_len=64, datapath=str(tmp_path / "v1" / "data"))
    got = [sds[k] for k in range(3)]
    assert sorted(g["hidden_states"].shape[1] for g in got) == [5 * 16] * 3


def test_data_config_names_the_engines_version_alone() -> None:
    """package_versions.transformers held the whole engine string ("transformers 5.25.0 / torch 2.13.0+cpu")."""
    from hsextract.export.speculators_v1 import _version_of

    meta = {"engine": "transformers", "engine_version": "transformers 5.25.0 / torch 2.13.0+cpu"}
    assert _version_of("transformers", meta) == "5.25.0" and _version_of("vllm", meta) is None
    assert _version_of("vllm", {"engine": "vllm", "engine_version": "vllm 0.11.0"}) == "0.11.0"
    assert _version_of("transformers", {"engine": "sglang", "engine_version": "sglang 0.5.16"}) is None


def test_a_second_export_into_the_same_folder_at_once_is_refused(run_dir, tmp_path):
    """Two exports into one folder at once replaced each other unasked, and the later one's start removed the
    earlier one's folder in the making: the one that comes second is refused while the first holds the lock."""
    import fcntl

    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # an export of another process, running
        with pytest.raises(ConfigError) as e:
            export(run_dir, out, "speculators-v1")
        assert str(e.value) == (f"{out}: another export into this folder is running (it holds {lock}); wait for it "
                                "to end, or export into another folder")
        assert not out.exists()
    finally:
        os.close(fd)
    assert export(run_dir, out, "speculators-v1")["out_dir"] == str(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # the lock file removed after


SMALL_DISK_EXPORT = """
import resource, signal, sys
from hsextract.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64_000, 64_000))  # EFBIG past 64 kB, as a full disk's ENOSPC
sys.exit(main(["export", "--format", sys.argv[1], sys.argv[2], sys.argv[3]]))
"""


@pytest.mark.parametrize("fmt", ["speculators-v1", "speculators-safetensors"])
def test_a_full_disk_during_an_export_is_the_cli_s_one_line_naming_the_file(tmp_path, fmt):
    """A sample's file that cannot be written (here past the file-size limit) is an OSError naming it, as from every
    writer (safetensors' own error is no OSError and names no file): the command's one-line error, no output."""
    import subprocess

    run = tmp_path / "run"
    (run / "shards").mkdir(parents=True)
    with ShardWriter(run / "shards" / "chunk-00000.hss", shard_metadata(chunk=0, final_state="post_norm")) as w:
        w.add(*make_sample(2000, seed=1), sample_id="long")  # 2000 x 4 x 16 bf16: 256 kB of hidden states
    finish_run(run)
    proc = subprocess.run([sys.executable, "-c", SMALL_DISK_EXPORT, fmt, str(run), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    name = {"speculators-v1": "data/data_0.pt", "speculators-safetensors": "hidden_states/hs_0.safetensors"}[fmt]
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert last.startswith(f"hsextract export: error: {tmp_path}/.out.") and f".tmp/{name}: File too large; " in last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no out/, no temporary folder
