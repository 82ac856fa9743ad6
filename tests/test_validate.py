"""Validation: the reference validates; every check fails on a sample crafted to break it, with its exact line."""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import make_sample, shard_metadata

from hsextract.cli import main
from hsextract.config.reference import ReferenceSampleError
from hsextract.config.reference import load as load_reference
from hsextract.report.validate import check_sample, failure_line, reference_layout, validate_shard
from hsextract.shard import ShardReader, ShardWriter
from hsextract.shard import format as fmt

REFERENCE = "resources/reference/speculators-v1-data_0.pt"


@pytest.fixture
def ref16(tmp_path):
    """A v1 reference sample of the tests' small model (hidden 16, 4 tensors)."""
    ids, hs, mask = make_sample(5, seed=99)
    path = tmp_path / "ref.pt"
    torch.save({"input_ids": ids, "hidden_states": hs, "loss_mask": mask}, path)
    return path


def write_shard(path, samples, **meta):
    with ShardWriter(path, shard_metadata(**meta)) as w:
        for k, (ids, hs, mask) in enumerate(samples):
            w.add(ids, hs, mask, sample_id=f"s{k}")
    return path


def run_validate(capsys, *args):
    code = main(["validate", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err


def test_bundled_reference_sample_validates_with_its_hidden_size(tmp_path, capsys):
    ref = load_reference(REFERENCE)
    assert ref["hidden_states"][0].shape == (24, 7168) and len(ref["hidden_states"]) == 4
    assert check_sample(ref, reference_layout(ref), vocab_size=None, same_model=True) == []
    shard = write_shard(tmp_path / "ref.hss", [(ref["input_ids"], ref["hidden_states"], ref["loss_mask"])],
                        hidden_size=7168)
    report = validate_shard(shard, REFERENCE, same_model=True, report_path=tmp_path / "r.json")
    assert report["passed"] and report["num_samples"] == 1 and report["num_tokens"] == 24
    assert report["num_trained"] == int(ref["loss_mask"].sum())
    assert all(c["failed"] == 0 and c["first"] is None for c in report["checks"].values())
    assert json.loads((tmp_path / "r.json").read_text()) == report
    code, lines, _ = run_validate(capsys, "--reference", REFERENCE, "--same-model", shard)
    assert code == 0 and lines == ["validated 1 of 1 shards: all passed (1 samples, 24 tokens)"]


def test_hidden_size_is_compared_only_for_the_same_model(tmp_path):
    shard = write_shard(tmp_path / "a.hss", [make_sample(4)])  # hidden 16 vs the reference's 7168
    assert validate_shard(shard, REFERENCE)["passed"]
    report = validate_shard(shard, REFERENCE, same_model=True)
    assert not report["passed"]
    assert failure_line(report) == (
        f"{shard}: sample 0 (id s0): check layout failed: hidden_states[0] has hidden size 16, reference has 7168")
    # the workflow's validate rule: the shard stays, so the same command alone would fail again
    assert failure_line(report, advice=True) == (
        f"{shard}: sample 0 (id s0): check layout failed: hidden_states[0] has hidden size 16, reference has 7168. "
        f"The shard holds what the engine computed, so extracting it again gives the same: check the model, the "
        f"reference sample and the config (then delete {shard} and run the same command)")
    assert failure_line(validate_shard(shard, REFERENCE), advice=True) is None


def _break(kind):
    ids, hs, mask = make_sample(6, seed=1)
    if kind == "finite":
        hs[2][3, 5] = float("nan")
        hs[2][4, 0] = float("inf")
    elif kind == "zero_row":
        hs[0][2].zero_()
    elif kind == "mask_values":
        mask[0] = 2
    elif kind == "mask_empty":
        mask.zero_()
    elif kind == "input_ids":
        ids[4] = 1000
    return ids, hs, mask


def test_report_dir_refuses_two_shards_of_one_name(tmp_path, capsys, ref16):
    a, b = tmp_path / "x/chunk-00000.hss", tmp_path / "s/chunk-00000.hss"
    for p in (a, b):
        p.parent.mkdir()
        write_shard(p, [make_sample(6, seed=1)], vocab_size=1000)
    code, lines, err = run_validate(capsys, "--reference", ref16, "--report-dir", tmp_path / "r", a, b)
    assert code == 2 and lines == [] and not (tmp_path / "r").exists()
    assert err == (f"hsextract validate: error: --report-dir: {a} and {b} would both write "
                   f"{tmp_path / 'r' / 'chunk-00000.json'}; validate them apart\n")


def test_a_report_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys):
    """Neither the reference (missing here) nor the shard (a missing file) is read before the check."""
    afile, adir = tmp_path / "afile", tmp_path / "adir.hss"
    afile.write_text("")
    adir.mkdir()
    (tmp_path / "reports" / "S.json").mkdir(parents=True)
    shard, ref = tmp_path / "S.hss", tmp_path / "nope.pt"
    cases = {
        ("--report-dir", afile): f"--report-dir: {afile} is not a folder, so the report {afile / 'S.json'} cannot "
                                 "be written; choose another folder",
        ("--report", adir): f"--report: {adir} is a folder, where a report file would go; name a file, or use "
                            "--report-dir for a folder of reports",
        ("--report", afile / "sub" / "r.json"): f"--report: {afile} is not a folder, so the report "
                                                f"{afile / 'sub' / 'r.json'} cannot be written; choose another file",
        ("--report-dir", tmp_path / "reports"): f"--report-dir: {tmp_path / 'reports' / 'S.json'} is a folder, "
                                                "where a report file would go; move that folder away or choose "
                                                "another --report-dir",
    }
    for (option, path), message in cases.items():
        assert run_validate(capsys, "--reference", ref, option, path, shard) == (
            2, [], f"hsextract validate: error: {message}\n")
    assert afile.read_text() == "" and list(adir.iterdir()) == []


def test_a_report_path_naming_an_input_is_refused_and_the_input_kept(tmp_path, capsys, ref16):
    shard = tmp_path / "S.hss"
    write_shard(shard, [make_sample(6, seed=1)], vocab_size=1000)
    before = {p: p.read_bytes() for p in (shard, Path(ref16))}
    (tmp_path / "link.json").symlink_to(shard)
    for option, path, same in (("--report", shard, shard), ("--report", ref16, Path(ref16)),
                               ("--report", tmp_path / "link.json", shard)):
        assert run_validate(capsys, "--reference", ref16, option, path, shard) == (
            2, [], f"hsextract validate: error: {option}: the report {path} would overwrite the input {same}; "
                   "choose another file\n")
    assert {p: p.read_bytes() for p in before} == before


@pytest.mark.parametrize("value,why", [("-3", "-3 is not >= 1"), ("0", "0 is not >= 1"),
                                       ("x", "'x' is not an integer")])
def test_vocab_size_below_one_is_a_usage_error(capsys, value, why):
    with pytest.raises(SystemExit) as e:
        main(["validate", "--reference", "r.pt", "--vocab-size", value, "s.hss"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"hsextract validate: error: argument --vocab-size: {why}"


def test_a_given_vocab_size_never_widens_the_shards_own(tmp_path, ref16):
    bad = tmp_path / "bad.hss"
    write_shard(bad, [_break("input_ids")], vocab_size=1000)  # id 1000 in a vocabulary of 1000
    for given in (None, 100_000, 1000):
        report = validate_shard(bad, ref16, vocab_size=given)
        assert not report["passed"] and report["vocab_size"] == 1000, given
    assert validate_shard(bad, ref16, vocab_size=100_000)["notes"] == [
        "vocab_size given 100000, the shard's 1000: ids checked against the smaller"]
    assert not validate_shard(tmp_path / "bad.hss", ref16, vocab_size=999)["passed"]


@pytest.mark.parametrize("kind,check,detail", [
    # each tensor named as the statistics and dataset.json name it (its place in the sample's list, and its layer)
    ("finite", "finite", "tensor 2 (hidden_states[3]) has 2 non-finite values, first at (3, 5)"),
    ("zero_row", "zero_row", "tensor 0 (hidden_states[1]) has 1 all-zero rows, first at token 2"),
    ("mask_values", "loss_mask", "values [0, 1, 2], only 0 and 1 allowed"),
    ("mask_empty", "loss_mask", "no token has loss_mask 1 (nothing to train on)"),
    ("input_ids", "input_ids", "id 1000 at token 4 outside [0, 1000)"),
])
def test_each_content_check_fails_with_its_line(tmp_path, capsys, ref16, kind, check, detail):
    good = tmp_path / "good.hss"
    write_shard(good, [make_sample(6, seed=k) for k in range(3)], vocab_size=1000)
    bad = tmp_path / "bad.hss"
    write_shard(bad, [make_sample(6, seed=7), _break(kind), make_sample(6, seed=8)], vocab_size=1000)
    code, lines, err = run_validate(capsys, "--reference", ref16, "--report-dir", tmp_path / "reports", good, bad)
    assert code == 1
    assert lines == [f"{bad}: sample 1 (id s1): check {check} failed: {detail}"]
    assert "1 of 2 shards failed validation" in err
    report = json.loads((tmp_path / "reports" / "bad.json").read_text())
    assert report["passed"] is False and report["num_samples"] == 3 and report["num_tokens"] == 18
    assert report["checks"][check] == {"failed": 1, "first": {"sample": 1, "sample_id": "s1", "detail": detail}}
    assert sum(c["failed"] for c in report["checks"].values()) == 1
    assert json.loads((tmp_path / "reports" / "good.json").read_text())["passed"] is True


def test_vocab_size_from_the_command_line(tmp_path, capsys, ref16):
    bad = write_shard(tmp_path / "a.hss", [_break("input_ids")])  # no vocab_size in the metadata
    code, lines, _ = run_validate(capsys, "--reference", ref16, bad)
    # ids are >= 0; the bound is unknown
    assert code == 0 and len(lines) == 1 and lines[0].startswith("validated 1 of 1 shards: all passed (1 samples, ")
    assert validate_shard(bad, ref16)["notes"][0].startswith("vocab_size unknown")
    code, lines, _ = run_validate(capsys, "--reference", ref16, "--vocab-size", "1000", bad)
    assert code == 1
    assert lines == [f"{bad}: sample 0 (id s0): check input_ids failed: id 1000 at token 4 outside [0, 1000)"]


def test_several_failures_still_one_line_naming_the_first(tmp_path, capsys, ref16):
    ids, hs, mask = _break("zero_row")
    mask.zero_()
    bad = write_shard(tmp_path / "a.hss", [make_sample(3), (ids, hs, mask), _break("finite")])
    code, lines, _ = run_validate(capsys, "--reference", ref16, bad)
    assert code == 1
    assert lines == [f"{bad}: sample 1 (id s1): check zero_row failed: tensor 0 (hidden_states[1]) has 1 all-zero "
                     "rows, first at token 2 [also failed: finite, loss_mask]"]


def test_layout_against_the_reference(tmp_path, ref16):
    fp16 = write_shard(tmp_path / "b.hss", [make_sample(4, dtype=torch.float16)], dtype="float16")
    assert failure_line(validate_shard(fp16, ref16)) == (
        f"{fp16}: sample 0 (id s0): check layout failed: hidden_states[0] has dtype float16, reference has bfloat16")
    layout = reference_layout(torch.load(ref16, weights_only=True))
    ids, hs, mask = make_sample(4)
    assert check_sample({"input_ids": ids, "hidden_states": hs}, layout) == [
        ("layout", "keys ['hidden_states', 'input_ids'], reference has ['hidden_states', 'input_ids', 'loss_mask']")]
    assert check_sample({"input_ids": ids, "hidden_states": torch.stack(hs), "loss_mask": mask}, layout)[0] == (
        "layout", "hidden_states is a tensor, reference has a list")
    assert check_sample({"input_ids": ids[None], "hidden_states": hs, "loss_mask": mask}, layout)[0] == (
        "layout", "input_ids has rank 2, reference has rank 1")
    # the count: the reference's unless the shard's is given (validate_shard gives its num_hidden_tensors)
    three = {"input_ids": ids, "hidden_states": hs[:3], "loss_mask": mask}
    assert check_sample(three, layout) == [("layout", "hidden_states has 3 tensors, reference has 4")]
    assert check_sample(three, layout, num_tensors=3) == []
    assert check_sample(three, layout, num_tensors=6) == [
        ("layout", "hidden_states has 3 tensors, the shard's aux layers + final state make 6")]
    assert check_sample(three, layout, num_tensors=4) == [("layout", "hidden_states has 3 tensors, reference has 4")]


@pytest.mark.parametrize("aux_layers,n", [([2, 3, 5, 7, 8], 6), ([], 1), ([1, 2], 3)])
def test_a_run_of_another_tensor_count_than_the_reference(tmp_path, capsys, aux_layers, n):
    """capture: dflash (6 tensors) and mtp (1) against the shipped 4-tensor reference: each tensor has the
    reference's layout, the count is the shard's own (its aux layers), and the report's notes say so."""
    shard = write_shard(tmp_path / "a.hss", [make_sample(5, n=n, seed=k) for k in range(2)], aux_layers=aux_layers)
    report = validate_shard(shard, REFERENCE, vocab_size=1000)
    assert report["passed"], failure_line(report)
    which = f"aux_layers {aux_layers} + the final state" if aux_layers else "no aux layer: the final state only"
    assert report["notes"] == [
        f"the reference holds 4 hidden-state tensors, this shard {n} ({which}): each tensor compared with the "
        "reference's layout, the count with the shard's aux layers"]
    code, lines, _ = run_validate(capsys, "--reference", REFERENCE, "--vocab-size", "1000", shard)
    assert code == 0 and lines == ["validated 1 of 1 shards: all passed (2 samples, 10 tokens)"]
    # the layout of each tensor is still the reference's: another dtype fails every one, the first named
    fp16 = write_shard(tmp_path / "b.hss", [make_sample(5, n=n, dtype=torch.float16)], aux_layers=aux_layers,
                       dtype="float16")
    assert failure_line(validate_shard(fp16, REFERENCE)) == (
        f"{fp16}: sample 0 (id s0): check layout failed: hidden_states[0] has dtype float16, reference has bfloat16")
    # and its hidden size, with same_model
    assert failure_line(validate_shard(shard, REFERENCE, same_model=True)) == (
        f"{shard}: sample 0 (id s0): check layout failed: hidden_states[0] has hidden size 16, reference has 7168")


def test_seq_len_check(ref16):
    layout = reference_layout(torch.load(ref16, weights_only=True))
    ids, hs, mask = make_sample(5)
    hs[1] = hs[1][:4]
    assert check_sample({"input_ids": ids, "hidden_states": hs, "loss_mask": mask}, layout) == [
        ("seq_len", "input_ids 5, loss_mask 5, hidden_states[0] 5, hidden_states[1] 4, hidden_states[2] 5, "
                    "hidden_states[3] 5")]


def test_checksum_failure_names_the_sample_and_continues(tmp_path, capsys, ref16):
    path = write_shard(tmp_path / "a.hss", [make_sample(6, seed=k) for k in range(3)])
    data = bytearray(path.read_bytes())
    off = ShardReader(path).index["offsets"][1]
    data[off + fmt.RECORD.size + 40] ^= 0x10
    path.write_bytes(bytes(data))
    report = validate_shard(path, ref16)
    assert report["checks"]["checksum"] == {"failed": 1,
                                            "first": {"sample": 1, "sample_id": "s1", "detail": "checksum mismatch"}}
    assert report["num_samples"] == 3
    code, lines, _ = run_validate(capsys, "--reference", ref16, path)
    assert code == 1 and lines == [f"{path}: sample 1 (id s1): check checksum failed: checksum mismatch"]


def test_truncated_shard_gives_a_report_and_a_line(tmp_path, capsys, ref16):
    path = write_shard(tmp_path / "a.hss", [make_sample(6, seed=k) for k in range(4)])
    offs = ShardReader(path).index["offsets"]
    path.write_bytes(path.read_bytes()[: offs[2] + 30])
    code, lines, _ = run_validate(capsys, "--reference", ref16, "--report", tmp_path / "r.json", path)
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"{path}: sample 2: check integrity failed: file truncated at byte {offs[2] + 30}")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] is False and report["num_samples"] is None
    assert report["checks"]["integrity"]["failed"] == 1 and report["checks"]["integrity"]["first"]["sample"] == 2


def test_a_shard_named_for_another_chunk_fails(tmp_path, capsys, ref16):
    """Shards swapped between two chunks' names each validated (an outside audit: both passed): the name a shard has
    must be the chunk its metadata says. A name of another pattern is not compared."""
    a = write_shard(tmp_path / "chunk-00000.hss", [make_sample(6, seed=1)], chunk=1, run_name="r")
    code, lines, _ = run_validate(capsys, "--reference", ref16, a)
    assert (code, lines) == (1, [
        f"{a}: shard structure: check integrity failed: named for chunk 0, it holds chunk 1 of run 'r' (its "
        "metadata): renamed, or swapped with another chunk's shard; give it its name, chunk-00001.hss"])
    b = write_shard(tmp_path / "chunk-00001.hss", [make_sample(6, seed=1)], chunk=1, run_name="r")
    other = write_shard(tmp_path / "run-r-chunk-00000.hss", [make_sample(6, seed=1)], chunk=1, run_name="r")
    assert validate_shard(b, ref16)["passed"] and validate_shard(other, ref16)["passed"]


def test_damaged_header_names_the_shard_structure(tmp_path, ref16):
    path = write_shard(tmp_path / "a.hss", [make_sample(3)])
    data = bytearray(path.read_bytes())
    data[fmt.HEADER.size + 3] ^= 1
    path.write_bytes(bytes(data))
    assert failure_line(validate_shard(path, ref16)) == (
        f"{path}: shard structure: check integrity failed: header metadata checksum mismatch")


def test_reference_must_load_without_pickle(tmp_path):
    bad = tmp_path / "obj.pt"
    torch.save([1, 2], bad)
    with pytest.raises(ReferenceSampleError,
                       match=r"^reference_sample: .*obj.pt is not a speculators v1 sample: it holds a list"):
        load_reference(bad)
    with pytest.raises(ReferenceSampleError, match=r"^reference_sample: .*missing.pt: no such file"):
        load_reference(tmp_path / "missing.pt")


class NotATensor:
    pass


def test_reference_with_pickled_objects_is_refused(tmp_path):
    bad = tmp_path / "pickled.pt"
    torch.save({"input_ids": NotATensor()}, bad)
    with pytest.raises(ReferenceSampleError,
                       match=r"^reference_sample: .*pickled.pt cannot be loaded with weights_only=True"):
        load_reference(bad)


def test_the_commands_report_equals_the_workflows_byte_for_byte(tmp_path, capsys, ref16):
    """`hsextract validate --report-dir` recorded the reference as "<in memory>" and wrote indent 2, so its report
    differed from the workflow's (validate_shard, then write_json_atomic) for the same shard."""
    from hsextract.atomic import write_json_atomic

    shard = write_shard(tmp_path / "S.hss", [make_sample(6, seed=1)])
    code, _, _ = run_validate(capsys, "--reference", ref16, "--report-dir", tmp_path / "r", shard)
    assert code == 0
    write_json_atomic(tmp_path / "wf.json", validate_shard(shard, ref16))
    assert (tmp_path / "r/S.json").read_bytes() == (tmp_path / "wf.json").read_bytes()
    assert json.loads((tmp_path / "wf.json").read_text())["reference"] == str(ref16)


def test_a_file_that_is_no_shard_is_named_once(tmp_path):
    other = tmp_path / "notes.hss"
    other.write_bytes(b"not a shard, and long enough to hold a header")
    assert failure_line(validate_shard(other, REFERENCE)) == (
        f"{other}: shard structure: check integrity failed: not an hsextract shard (bad magic at byte 0); a shard "
        "damaged at its start reads so too: if this is one of a run's shards, delete it and rerun its chunk")
    dotted = f"./{os.path.relpath(other)}"  # ShardError spells it without "./": still named once
    assert failure_line(validate_shard(dotted, REFERENCE)).startswith(
        f"{dotted}: shard structure: check integrity failed: not an hsextract shard (bad magic at byte 0); ")
    empty = tmp_path / "chunk-00000.hss"
    empty.write_bytes(b"")
    assert failure_line(validate_shard(empty, REFERENCE), advice=True) == (
        f"{empty}: shard structure: check integrity failed: file truncated at byte 0: inside the 20-byte header. "
        f"Delete {empty} and run the same command: its chunk alone is extracted again")
