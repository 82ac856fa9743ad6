"""Chunk arithmetic (hsextract.config.chunks): the count, the names and the records of a chunk."""

from __future__ import annotations

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
