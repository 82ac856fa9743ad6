"""Progress bars on a terminal only (prepare, validate, export), and the one-line summaries on success."""

from __future__ import annotations

import io
import sys

import pytest
from conftest import finish_run, make_sample, shard_metadata

from hsextract.cli import main
from hsextract.progress import ProgressDataset, bar
from hsextract.shard import ShardWriter


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_draws_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    assert list(bar(range(3), desc="validate", unit="shard")) == [0, 1, 2]
    assert log.getvalue() == ""  # a log file or a pipe gets no bar
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
