"""Progress: bars on a terminal, lines in a log (prepare, extract, validate, export), and the one-line summaries on
success."""

from __future__ import annotations

import io
import re
import sys

import pytest
from conftest import finish_run, make_sample, shard_metadata

from hsextract import progress
from hsextract.cli import main
from hsextract.progress import ProgressDataset, bar
from hsextract.shard import ShardWriter


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_draws_on_a_terminal_and_writes_lines_to_a_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """A log or a pipe gets whole lines (count, rate, time taken and left), at most every LOG_EVERY_S, and the end
    where it got any: none for short work, none with a rate after work stopped short (an error)."""
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    monkeypatch.setattr(progress, "LOG_EVERY_S", 1e9)
    assert list(bar(range(3), desc="validate", unit="shard")) == [0, 1, 2]
    assert log.getvalue() == ""  # short work: nothing
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # a line at every step
    assert list(bar(range(3), desc="validate", unit="shard")) == [0, 1, 2]
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 3, lines  # the last step's line is the end's
    for line, want in zip(lines, ["1/3 shard (33%)", "2/3 shard (67%)", "3/3 shard (100%)"], strict=True):
        assert re.fullmatch(rf"validate: {re.escape(want)}, [0-9.]+[kMG]? shard/s, \d\d:\d\d taken"
                            rf"(, \d\d:\d\d left)?", line), line
    log.seek(0)
    log.truncate()
    with pytest.raises(RuntimeError):
        for i in bar(range(3), desc="export", unit="sample"):
            if i == 1:
                raise RuntimeError("stopped")
    assert [line.split(", ")[0] for line in log.getvalue().splitlines()] == ["export: 1/3 sample (33%)"]
    log.seek(0)
    log.truncate()
    c = progress.counter(5000, desc="chunk-00000.hss", unit="tok")
    c.update(2500)
    monkeypatch.setattr(progress, "LOG_EVERY_S", 1e9)  # the last step between lines: the end says it
    c.update(2500)
    c.close()
    assert [line.split(", ")[0] for line in log.getvalue().splitlines()] == [
        "chunk-00000.hss: 2,500/5,000 tok (50%)", "chunk-00000.hss: 5,000/5,000 tok (100%)"]
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    assert list(bar(range(3), desc="validate", unit="shard")) == [0, 1, 2]
    assert "\rvalidate:   0%|          | 0/3 [" in tty.getvalue()  # drawn, then cleared (leave=False)


def test_progress_dataset_is_the_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    class Data:
        metadata = {"final_state": "post_norm"}

        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> int:
            if i >= 2:
                raise IndexError(i)
            return i * 10

    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    ds = ProgressDataset(Data(), "export specforge")
    assert len(ds) == 2 and ds[1] == 10 and ds.metadata == {"final_state": "post_norm"}
    assert list(ds) == [0, 10] and list(enumerate(ds)) == [(0, 0), (1, 10)]
    assert "\rexport specforge:   0%|          | 0/2 [" in tty.getvalue()


@pytest.fixture
def run_dir(tmp_path):
    path = tmp_path / "run" / "shards" / "chunk-00000.hss"
    path.parent.mkdir(parents=True)
    with ShardWriter(path, shard_metadata(run_name="t", vocab_size=1000)) as w:
        for k in range(3):
            w.add(*make_sample(4 + k, seed=k), sample_id=f"c{k}")
    return finish_run(path.parent.parent)


def test_validate_and_export_bars_and_summaries_on_a_terminal(run_dir, tmp_path, monkeypatch, capsys) -> None:
    import torch

    shard = run_dir / "shards/chunk-00000.hss"
    ref = tmp_path / "ref.pt"
    s = make_sample(5, seed=9)
    torch.save({"input_ids": s[0], "hidden_states": s[1], "loss_mask": s[2]}, ref)
    assert main(["validate", "--reference", str(ref), str(shard)]) == 0
    out = capsys.readouterr()
    assert out.out == "validated 1 of 1 shards: all passed (3 samples, 15 tokens)\n"
    assert out.err == ""  # captured stderr is no terminal: no bar
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["export", "--format", "specforge", str(run_dir), str(tmp_path / "out")]) == 0
    assert "\rexport specforge:   0%|          | 0/3 [" in tty.getvalue()
    assert capsys.readouterr().out.startswith(f"exported 3 samples (15 tokens) as specforge to {tmp_path / 'out'}\n")
    assert main(["validate", "--reference", str(ref), str(shard)]) == 0
    assert "\rvalidate:   0%|          | 0/1 [" in tty.getvalue()


def test_the_runs_last_word_is_its_dataset_json_written_by_this_invocation(tmp_path) -> None:
    """Snakefile's onsuccess line: what dataset.json holds and where, only where this invocation wrote it (another
    file or other data than at its start: not a target short of the manifest, a run with nothing to do, nor
    `--touch`, which sets the time of the same file; a rewrite into the inode Snakemake freed is told by its data),
    and nothing from a file of another shape."""
    import os

    from hsextract.atomic import write_json_atomic
    from hsextract.report.manifest import finished_line, manifest_stamp

    assert manifest_stamp(tmp_path) is None
    counts = {"samples": 1234, "tokens": 567890, "trained_tokens": 400000, "chunks": 3, "bytes_stored": 2_500_000_000,
              "dropped_records": 0}
    write_json_atomic(tmp_path / "dataset.json", {"counts": counts})
    line = (f"hsextract: {tmp_path / 'dataset.json'}: 1,234 samples, 567,890 tokens (400,000 trained) in 3 shards, "
            "2.500 GB (2,500,000,000 B) stored")
    assert finished_line(tmp_path, before=None) == line
    before = manifest_stamp(tmp_path)
    os.utime(tmp_path / "dataset.json")  # --touch
    assert finished_line(tmp_path, before) is None
    # the manifest job: Snakemake deletes the old file first, the new one may get its inode back
    (tmp_path / "dataset.json").unlink()
    write_json_atomic(tmp_path / "dataset.json", {"counts": {**counts, "dropped_records": 7}})
    assert finished_line(tmp_path, before) == line.replace("stored", "stored; prepare dropped 7 records (stats/ "
                                                                     "says why)")
    assert finished_line(tmp_path, manifest_stamp(tmp_path)) is None  # a later run with nothing to do
    for other in ("[]", '{"counts": 3}', '{"counts": {"samples": 1}}', "not json"):
        (tmp_path / "dataset.json").write_text(other)
        assert finished_line(tmp_path, None) is None
    assert finished_line(tmp_path / "none", None) is None


def test_a_dataset_json_that_is_no_regular_file_is_not_read(tmp_path) -> None:
    """Read at every parse of the Snakefile: a FIFO would block every command, /dev/zero fill the memory."""
    import os

    from hsextract.report.manifest import finished_line, manifest_stamp

    os.mkfifo(tmp_path / "dataset.json")
    assert manifest_stamp(tmp_path) is None and finished_line(tmp_path, None) is None
    (tmp_path / "dataset.json").unlink()
    (tmp_path / "dataset.json").symlink_to("/dev/zero")
    assert manifest_stamp(tmp_path) is None and finished_line(tmp_path, (1, "x")) is None
