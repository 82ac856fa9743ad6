"""Chunk arithmetic (hsextract.config.chunks): the count, the names and the records of a chunk."""

from __future__ import annotations

import os
import re

import pytest

from hsextract.config import chunks
from hsextract.prepare.run import chunk_name
from hsextract.shard import SHARD_SUFFIX


@pytest.mark.parametrize(("n_records", "ppc", "want"), [(1, 64, 1), (64, 64, 1), (65, 64, 2), (10, 4, 3), (95, 19, 5)])
def test_count(n_records: int, ppc: int, want: int) -> None:
    assert chunks.count(n_records, ppc) == want


def test_names_and_labels() -> None:
    assert chunks.label(7) == "00007"
    assert chunks.labels(3) == ["00000", "00001", "00002"]
    assert chunks.name(12, ".parquet") == "chunk-00012.parquet" == chunk_name(12)
    assert chunks.name(0, SHARD_SUFFIX) == "chunk-00000.hss"
    # the rules' chunk wildcard matches every label and nothing else
    assert all(re.fullmatch(chunks.WILDCARD, lab) for lab in chunks.labels(12))
    assert not re.fullmatch(chunks.WILDCARD, "0001") and not re.fullmatch(chunks.WILDCARD, "000001")


def test_records_partition_the_input() -> None:
    n, ppc = 10, 4
    parts = [chunks.records(c, ppc, n) for c in range(chunks.count(n, ppc))]
    assert [list(r) for r in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(chunks.of_record(k, ppc) == c for c, r in enumerate(parts) for k in r)


def test_remove_beyond_removes_exactly_the_later_chunks_files(tmp_path, capsys) -> None:
    """An earlier configuration's per-chunk files (chunk >= the count now) are removed, one line each; nothing that
    is not named exactly `chunk-NNNNN<suffix>` (or a killed write's temporary file of one) is touched: other names,
    other suffixes, folders, a link's target."""
    d = tmp_path / "prompts"
    d.mkdir()
    for name in ("chunk-00000.parquet", "chunk-00001.parquet", "chunk-00002.parquet", "chunk-00010.parquet",
                 "chunk-00003.parquet.bak", "chunk-3.parquet", "chunk-000004.parquet", "chunk-00005.json",
                 ".chunk-00006.parquet.x1.tmp", "summary.json", "xchunk-00007.parquet",
                 ".chunk-00006.parquet.0123456789abcdef.tmp", ".chunk-00000.parquet.0123456789abcdef.tmp"):
        (d / name).write_text("x")
    (d / "chunk-00008.parquet").mkdir()  # a folder of that name: not a per-chunk file
    target = tmp_path / "elsewhere.parquet"
    target.write_text("keep me")
    (d / "chunk-00009.parquet").symlink_to(target)
    assert [(p.name, c) for p, c in chunks.beyond(d, ".parquet", 1)] == [
        ("chunk-00001.parquet", 1), ("chunk-00002.parquet", 2), (".chunk-00006.parquet.0123456789abcdef.tmp", 6),
        ("chunk-00009.parquet", 9), ("chunk-00010.parquet", 10)]
    gone = ("chunk-00001.parquet", "chunk-00002.parquet", ".chunk-00006.parquet.0123456789abcdef.tmp",
            "chunk-00009.parquet", "chunk-00010.parquet")
    removed = chunks.remove_beyond(d, ".parquet", 1)
    assert tuple(p.name for p in removed) == gone
    assert capsys.readouterr().out.splitlines() == [
        f"removed {d / n}: chunk {c} of an earlier configuration (now 1 chunks)"
        for n, c in zip(gone, (1, 2, 6, 9, 10), strict=True)]
    assert sorted(p.name for p in d.iterdir()) == [  # chunk 0's temporary file: its next write removes it
        ".chunk-00000.parquet.0123456789abcdef.tmp", ".chunk-00006.parquet.x1.tmp", "chunk-00000.parquet",
        "chunk-000004.parquet", "chunk-00003.parquet.bak",
        "chunk-00005.json", "chunk-00008.parquet", "chunk-3.parquet", "summary.json", "xchunk-00007.parquet"]
    assert target.read_text() == "keep me"
    # nothing beyond the count: nothing removed, nothing printed; a missing folder holds nothing
    assert chunks.remove_beyond(d, ".parquet", 1) == [] == chunks.remove_beyond(tmp_path / "none", ".json", 0)
    assert capsys.readouterr().out == ""


def test_an_incomplete_prepare_beside_shards_is_warned_of(tmp_path):
    """prepare's output missing a file, shards there: the next extract reruns prepare and then every chunk."""
    run = tmp_path / "run"
    (run / "prompts").mkdir(parents=True)
    (run / "shards").mkdir()
    for c in range(3):
        (run / "prompts" / f"chunk-{c:05d}.parquet").write_bytes(b"p")
    (run / "prompts" / "summary.json").write_text("{}")
    assert chunks.incomplete_prepare(run, 3, ".hss") is None  # nothing missing
    (run / "prompts" / "chunk-00001.parquet").unlink()
    assert chunks.incomplete_prepare(run, 3, ".hss") is None  # no shard yet: nothing to lose
    (run / "shards" / "chunk-00000.hss").write_bytes(b"s")
    (run / "shards" / "chunk-00002.hss").write_bytes(b"s")
    assert chunks.incomplete_prepare(run, 3, ".hss") == (
        f"hsextract: WARNING: {run}/prompts/chunk-00001.parquet is missing (prepare writes every chunk's prompts in "
        "one job). Snakemake plans nothing for that, but the next run that extracts any chunk runs prepare again "
        "first, and then all 3 chunks: the 2 shards there would be extracted again. To keep them, restore the "
        "file(s) with their times (cp -p from a copy) before that run")
    # a config of more (or fewer) chunks than prepare wrote: the files are new chunks, and prepare reruns for the
    # config itself (Snakemake plans it): no word of a lost file
    (run / "prompts" / "chunk-00001.parquet").write_bytes(b"p")
    (run / "prompts" / "summary.json").write_text('{"num_chunks": 3}')
    assert chunks.incomplete_prepare(run, 3, ".hss") is None
    assert chunks.incomplete_prepare(run, 4, ".hss") is None and chunks.incomplete_prepare(run, 2, ".hss") is None
    (run / "prompts" / "chunk-00001.parquet").unlink()
    assert chunks.incomplete_prepare(run, 3, ".hss").startswith(
        f"hsextract: WARNING: {run}/prompts/chunk-00001.parquet is missing")
    for p in (run / "prompts").iterdir():
        p.unlink()
    assert chunks.incomplete_prepare(run, 3, ".hss").startswith(
        f"hsextract: WARNING: {run}/prompts/chunk-00000.parquet, {run}/prompts/chunk-00001.parquet, "
        f"{run}/prompts/chunk-00002.parquet and 1 more are missing")


def test_a_summary_of_another_shape_records_no_sha256_and_names_no_damage(tmp_path) -> None:
    """prompts/summary.json read at parse time (damaged_prompts), by extract and by the manifest: a file of another
    shape (a list, entries that are no mappings, a sha256 that is no text, nested past the parser's depth) records
    nothing, so nothing is refused or reported for it, and the Snakefile parses."""
    good = {"per_chunk": [{"chunk": 0, "sha256": "ab"}, {"chunk": 1, "sha256": "cd"}]}
    assert [chunks.written_sha256(good, c) for c in (0, 1, 2)] == ["ab", "cd", None]
    for other in ([], ["x"], {"per_chunk": 3}, {"per_chunk": [1, [2], None]},
                  {"per_chunk": [{"chunk": 0, "sha256": 5}]}):
        assert chunks.written_sha256(other, 0) is None
    (tmp_path / "prompts").mkdir()
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / chunks.name(0, SHARD_SUFFIX)).write_bytes(b"shard")
    (tmp_path / "prompts" / chunks.name(0, ".parquet")).write_bytes(b"changed")  # newer than the shard
    os.utime(tmp_path / "shards" / chunks.name(0, SHARD_SUFFIX), (1, 1))
    for text in ("[1, 2]", '{"per_chunk": [7]}', "[" * 100_000 + "]" * 100_000):
        (tmp_path / "prompts" / "summary.json").write_text(text)
        assert chunks.damaged_prompts(tmp_path, 1, SHARD_SUFFIX) is None
    (tmp_path / "prompts" / "summary.json").write_text('{"per_chunk": [{"chunk": 0, "sha256": "ab"}]}')
    assert chunks.damaged_prompts(tmp_path, 1, SHARD_SUFFIX).startswith(
        f"{tmp_path / 'prompts' / 'chunk-00000.parquet'} is newer than {tmp_path / 'shards' / 'chunk-00000.hss'}")


def test_a_summary_that_is_no_regular_file_is_not_read_at_parse_time(tmp_path) -> None:
    """A FIFO summary.json blocked every snakemake command at parse time, /dev/zero filled the memory: neither is
    read (nor a prompts file that is a FIFO)."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / chunks.name(0, SHARD_SUFFIX)).write_bytes(b"shard")
    os.utime(tmp_path / "shards" / chunks.name(0, SHARD_SUFFIX), (1, 1))
    os.mkfifo(tmp_path / "prompts" / chunks.name(0, ".parquet"))
    for make in (lambda p: os.mkfifo(p), lambda p: p.symlink_to("/dev/zero")):
        summary = tmp_path / "prompts" / "summary.json"
        summary.unlink(missing_ok=True)
        make(summary)
        assert chunks.damaged_prompts(tmp_path, 1, SHARD_SUFFIX) is None
        assert f"{summary} are missing" in chunks.incomplete_prepare(tmp_path, 1, SHARD_SUFFIX)  # and the FIFO
    summary.unlink()
    summary.write_text('{"per_chunk": [{"chunk": 0, "sha256": "ab"}]}')
    assert chunks.damaged_prompts(tmp_path, 1, SHARD_SUFFIX) is None  # the FIFO prompts file is not hashed
