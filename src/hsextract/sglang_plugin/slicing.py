"""Cut an EXTEND batch's rows into per-request pieces.

Rows are concatenated in `batch.reqs` order, `extend_lens[i]` rows each; request i's rows are the
absolute prompt positions [prefix_lens[i], prefix_lens[i] + extend_lens[i]). Rows past
sum(extend_lens) are padding (CUDA graphs, DP attention) and are ignored. Rows at positions >= the
prompt length are decode rows of a MIXED batch (or generated tokens of a re-run) and are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class ReqLike(Protocol):
    rid: str
    origin_input_ids: Sequence[int]


@dataclass(frozen=True)
class PieceSlice:
    rid: str
    n_tokens: int  # prompt length
    start: int  # first prompt position of the piece
    end: int  # one past the last
    row: int  # row of `start` in the batch tensors
    ids: Any  # the request's origin_input_ids (hashed when the request completes)


def slice_extend_batch(
    reqs: Sequence[ReqLike],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    num_rows: int,
    accept: Callable[[str], bool] = lambda rid: True,
    skip: Callable[[Any], bool] | None = None,
) -> list[PieceSlice]:
    """Pieces of the accepted requests of one EXTEND/MIXED batch whose tensors have `num_rows` rows.

    `skip(req)` drops a request by its object (a re-run of one whose prompt was already dumped)."""
    if not (len(reqs) == len(prefix_lens) == len(extend_lens)):
        raise ValueError(
            f"batch has {len(reqs)} reqs, {len(prefix_lens)} prefix lens, {len(extend_lens)} extend lens"
        )
    total = sum(int(e) for e in extend_lens)
    if total > num_rows:
        raise ValueError(f"extend lens sum to {total} rows but the captured tensor has {num_rows}")
    out: list[PieceSlice] = []
    off = 0
    for req, pre, ext in zip(reqs, prefix_lens, extend_lens, strict=True):
        pre, ext = int(pre), int(ext)
        rid = req.rid
        if ext > 0 and isinstance(rid, str) and accept(rid) and not (skip is not None and skip(req)):
            n = len(req.origin_input_ids)
            end = min(pre + ext, n)
            if pre < end:
                out.append(PieceSlice(rid, n, pre, end, off, req.origin_input_ids))
        off += ext
    return out
