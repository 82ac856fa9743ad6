"""Dataset statistics: per shard (one pass over its samples), then aggregated with pandas.

Per-shard results are JSON-able dicts of sums, so aggregation is exact: RMS over the dataset
is sqrt(sum of squares / count), never an average of per-shard RMS values.
"""

from __future__ import annotations

import json
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from hsextract.atomic import write_atomic
from hsextract.layers import HIDDEN_STATES, shard_hidden_states
from hsextract.prepare import drops
from hsextract.prepare.prefix_share import codec_ratio, raw_stored, share_saving, stored_tokens

SEQ_QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
# Values of one tensor taken to float64 at a time: a sample of a large model is GBs (Kimi-K2.5: 14 KB a row per
# tensor, 1.8 GB a tensor at 128k tokens), and float64 temporaries of it whole would be four times that, each.
BLOCK_VALUES = 1 << 23


def tensor_names(aux_layers: Sequence[int], final_state: str) -> list[str]:
    """Labels of a shard's tensors; `aux_layers` as hidden_states ids (hsextract.layers)."""
    return [f"hidden_states[{i}]" for i in aux_layers] + [f"final_{final_state}"]


def chunk_stats(shard_path: str | Path, position_bins: int = 64) -> dict[str, Any]:
    """One pass over a shard: counts, lengths, per-tensor sums of squares, abs max, token counts."""
    from hsextract.shard import ShardReader

    reader = ShardReader(shard_path)
    meta = reader.metadata
    aux = shard_hidden_states(meta)  # an old shard's layer-output ids, converted
    names = tensor_names(aux, meta["final_state"])
    n_t = len(names)
    hidden = int(meta["hidden_size"])
    sum_sq = np.zeros(n_t, dtype=np.float64)
    abs_max = np.zeros(n_t, dtype=np.float64)
    nonfinite = np.zeros(n_t, dtype=np.int64)
    pos_sum_sq = np.zeros((n_t, 0), dtype=np.float64)
    pos_tokens = np.zeros(0, dtype=np.int64)
    seq_lengths: list[int] = []
    trained_lengths: list[int] = []
    freq: Counter[int] = Counter()
    bytes_raw = ids_mask_bytes = row_bytes = 0
    for i in range(len(reader)):
        sample = reader[i]
        ids, mask, hs = sample["input_ids"], sample["loss_mask"], sample["hidden_states"]
        seq = int(ids.shape[0])
        seq_lengths.append(seq)
        trained_lengths.append(int(mask.sum()))
        freq.update(ids[mask.bool()].tolist())
        bytes_raw += ids.nbytes + mask.nbytes + sum(h.nbytes for h in hs)
        ids_mask_bytes += ids.nbytes + mask.nbytes
        row_bytes = sum(h.element_size() * h.shape[-1] for h in hs)  # one token's hidden states, every sample's
        bins = torch.arange(seq) // position_bins
        n_bins = int(bins[-1]) + 1 if seq else 0
        if n_bins > pos_tokens.shape[0]:
            grow = n_bins - pos_tokens.shape[0]
            pos_tokens = np.concatenate([pos_tokens, np.zeros(grow, dtype=np.int64)])
            pos_sum_sq = np.concatenate([pos_sum_sq, np.zeros((n_t, grow))], axis=1)
        pos_tokens[:n_bins] += np.bincount(bins.numpy(), minlength=n_bins)
        # blocks of 2 rows or more (a single row's sum reduces in another order): each row's sum of squares as
        # over the whole tensor at once
        rows = max(2, BLOCK_VALUES // max(1, hidden))
        starts = list(range(0, seq, rows))
        if len(starts) > 1 and seq - starts[-1] == 1:
            starts.pop()  # the last block takes the one row left
        for k, h in enumerate(hs):
            per_token = torch.zeros(seq, dtype=torch.float64)
            for r, end in zip(starts, [*starts[1:], seq], strict=True):
                b = h[r:end].to(torch.float64)
                finite = torch.isfinite(b)
                bad = int((~finite).sum())
                if bad:
                    nonfinite[k] += bad
                    b = torch.where(finite, b, torch.zeros_like(b))
                per_token[r:end] = (b * b).sum(dim=1)
                abs_max[k] = max(abs_max[k], float(b.abs().max()))
            sum_sq[k] += float(per_token.sum())
            pos_sum_sq[k, :n_bins] += np.bincount(bins.numpy(), weights=per_token.numpy(), minlength=n_bins)
    tokens = int(sum(seq_lengths))
    return {
        "shard": str(shard_path),
        "chunk": meta.get("chunk"),
        "aux_layers": aux,
        "layer_convention": HIDDEN_STATES,
        "final_state": meta["final_state"],
        "hidden_size": hidden,
        "format_version": int(meta["format_version"]),
        "samples": len(seq_lengths),
        "tokens": tokens,  # materialized: what a trainer reads
        "stored_tokens": reader.stored_tokens,  # rows stored (and computed): a shared prefix once
        "trained_tokens": int(sum(trained_lengths)),
        "seq_lengths": seq_lengths,
        "trained_lengths": trained_lengths,
        "bytes_raw": int(bytes_raw),  # the speculators v1 size: every sample whole
        # the same of what is stored: ids and mask of every token, hidden rows of the stored tokens only; the
        # codec's ratio is bytes_stored over this, and stored_over_raw also holds the shared prefixes' saving
        "bytes_raw_stored": int(ids_mask_bytes + row_bytes * reader.stored_tokens),
        "bytes_stored": Path(shard_path).stat().st_size,
        "tensors": [
            {"name": names[k], "sum_sq": float(sum_sq[k]), "count": tokens * hidden,
             "abs_max": float(abs_max[k]), "nonfinite": int(nonfinite[k])}
            for k in range(n_t)
        ],
        "position_bins": int(position_bins),
        "position_tokens": pos_tokens.tolist(),
        "position_sum_sq": pos_sum_sq.tolist(),
        "token_freq": {str(t): c for t, c in sorted(freq.items())},
    }


def iter_json_files(paths: Iterable[str | Path]) -> Iterator[dict[str, Any]]:
    """One JSON object per file, in order, each read when asked for: a consumer that folds them (ChunkTotals)
    holds one file's at a time."""
    for p in paths:
        with open(p, encoding="utf-8") as f:
            yield json.load(f)


def load_json_files(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """One JSON object per file, in order, all in memory: for small ones (validation reports)."""
    return list(iter_json_files(paths))


def _dropped(prepare_summary: Mapping[str, Any]) -> pd.DataFrame:
    """Prepare's drops by reason, each in its unit (a whole record, or one of a record's samples)."""
    dropped = prepare_summary.get("dropped") or {}
    rows = [(r, n, drops.unit(r)) for r, n in sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0]))]
    return pd.DataFrame(rows, columns=["reason", "dropped", "unit"]).astype({"dropped": "int64"})


_TENSOR_SUMS = ("name", "sum_sq", "count", "abs_max", "nonfinite")


class ChunkTotals:
    """Running totals over per-chunk statistics, added one chunk at a time (`add`, or an iterable such as
    `iter_json_files` given to the constructor): the tables and token frequencies over every chunk.

    A run has up to tens of thousands of chunks, each with up to a vocabulary's token counts, so the chunks' dicts
    are never all held: only a few numbers a chunk (its row, its tensors' rows), the position sums, one Counter
    and the sequence lengths as int64. The results are those of the whole list to the byte: the rows are summed
    by pandas at the end, the position sums are added in chunk order, the lengths keep their order."""

    def __init__(self, chunks: Iterable[Mapping[str, Any]] = ()) -> None:
        self.rows: list[dict[str, Any]] = []
        self.tensor_rows: list[tuple[Any, ...]] = []
        self.names: list[str] = []
        self.bin_size = self.hidden = 0
        self.pos_tokens = np.zeros(0, dtype=np.int64)
        self.pos_sum_sq = np.zeros((0, 0))
        self.lengths = array("q")  # int64, 8 bytes a sample
        self.freq: Counter[int] = Counter()
        for c in chunks:
            self.add(c)

    def add(self, c: Mapping[str, Any]) -> None:
        if not self.rows:  # the first chunk names the tensors, the position bin size and the hidden size
            self.names = [t["name"] for t in c["tensors"]]
            self.bin_size, self.hidden = int(c["position_bins"]), int(c["hidden_size"])
            self.pos_sum_sq = np.zeros((len(self.names), 0))
        self.rows.append(
            {"chunk": c["chunk"], "samples": c["samples"], "tokens": c["tokens"],
             "stored_tokens": stored_tokens(c), "trained_tokens": c["trained_tokens"], "bytes_raw": c["bytes_raw"],
             "bytes_raw_stored": raw_stored(c), "bytes_stored": c["bytes_stored"]}
        )
        self.tensor_rows.extend(tuple(t[k] for k in _TENSOR_SUMS) for t in c["tensors"])  # a tuple: half a dict
        m = len(c["position_tokens"])
        grow = m - self.pos_tokens.shape[0]
        if grow > 0:  # as many bins as the chunk with the longest sample
            self.pos_tokens = np.concatenate([self.pos_tokens, np.zeros(grow, dtype=np.int64)])
            self.pos_sum_sq = np.concatenate([self.pos_sum_sq, np.zeros((len(self.names), grow))], axis=1)
        self.pos_tokens[:m] += np.asarray(c["position_tokens"], dtype=np.int64)
        if m:
            self.pos_sum_sq[:, :m] += np.asarray(c["position_sum_sq"], dtype=np.float64)
        self.lengths.extend(c["seq_lengths"])
        self.freq.update({int(t): int(n) for t, n in c["token_freq"].items()})

    def token_freq(self) -> dict[int, int]:
        """Counts of trained (loss-mask 1) tokens over all chunks, as speculators' token_freq.pt holds."""
        return dict(sorted(self.freq.items()))

    def tables(self, prepare_summary: Mapping[str, Any]) -> dict[str, pd.DataFrame]:
        """Tables over all chunks: summary, chunks, layers, rms_by_position, seq_lengths, dropped."""
        if not self.rows:
            raise ValueError("aggregate: no chunk statistics given")
        names, hidden = self.names, self.hidden
        per_chunk = pd.DataFrame(self.rows)
        # an empty chunk has no ratio (NaN, as the totals), not an infinite one
        for col, raw in (("stored_over_raw", "bytes_raw"), ("codec_ratio", "bytes_raw_stored")):
            per_chunk[col] = (per_chunk["bytes_stored"] / per_chunk[raw].where(per_chunk[raw] > 0)).round(4)

        by_name = pd.DataFrame(self.tensor_rows, columns=_TENSOR_SUMS).groupby("name", sort=False).agg(
            sum_sq=("sum_sq", "sum"), count=("count", "sum"), abs_max=("abs_max", "max"),
            nonfinite=("nonfinite", "sum")
        ).reindex(names)
        layers = pd.DataFrame(
            {
                "tensor": names,
                "rms": np.sqrt(by_name["sum_sq"] / by_name["count"].clip(lower=1)).to_numpy(),
                "abs_max": by_name["abs_max"].to_numpy(),
                "nonfinite": by_name["nonfinite"].astype("int64").to_numpy(),
            }
        )

        tok, sq = self.pos_tokens, self.pos_sum_sq
        rms_pos = pd.DataFrame({"position_start": np.arange(tok.shape[0]) * self.bin_size, "tokens": tok.copy()})
        for k, name in enumerate(names):
            rms_pos[name] = np.sqrt(sq[k] / np.maximum(tok * hidden, 1))

        lengths = np.asarray(self.lengths, dtype=np.int64)
        if lengths.size:
            qs = np.quantile(lengths, SEQ_QUANTILES)
            seq = pd.DataFrame({"statistic": [f"q{int(q * 100):02d}" for q in SEQ_QUANTILES] + ["mean"],
                                "tokens": [float(v) for v in qs] + [float(lengths.mean())]})
        else:
            seq = pd.DataFrame({"statistic": [], "tokens": []})

        dropped = _dropped(prepare_summary)
        tokens, stored = int(per_chunk["tokens"].sum()), int(per_chunk["stored_tokens"].sum())
        tot_raw, tot_stored = int(per_chunk["bytes_raw"].sum()), int(per_chunk["bytes_stored"].sum())
        totals = {
            "chunks": len(self.rows),
            "samples": int(per_chunk["samples"].sum()),
            "tokens": tokens,
            "stored_tokens": stored,
            "share_saving": share_saving(tokens, stored),
            "trained_tokens": int(per_chunk["trained_tokens"].sum()),
            **drops.totals(prepare_summary.get("dropped") or {}),
            "bytes_raw": tot_raw,
            "bytes_stored": tot_stored,
            "stored_over_raw": round(tot_stored / tot_raw, 4) if tot_raw else float("nan"),
            "codec_ratio": codec_ratio(tot_stored, per_chunk["bytes_raw_stored"].sum(skipna=False)),
            "hidden_size": hidden,
            "tensors_per_sample": len(names),
        }
        summary = pd.DataFrame({"metric": list(totals), "value": pd.Series(list(totals.values()), dtype=object)})
        return {"summary": summary, "chunks": per_chunk, "layers": layers, "rms_by_position": rms_pos,
                "seq_lengths": seq, "dropped": dropped}


def write_table(df: pd.DataFrame, path: str | Path) -> None:
    text = df.to_csv(sep="\t", index=False, float_format="%.6g").encode()
    write_atomic(path, lambda f: f.write(text))
