"""speculators >=0.5 layout: an Arrow dataset of token ids and loss masks, one safetensors file per sample.

    OUT_DIR/data-00000-of-00001.arrow   Arrow IPC stream, columns input_ids list<int64>, loss_mask list<int64>,
                                        seq_len int64
    OUT_DIR/state.json                  the `datasets` save_to_disk state (format "torch"),
                                        so load_from_disk(OUT_DIR) works
    OUT_DIR/dataset_info.json           {} : features are read from the Arrow schema (any datasets >= 2)
    OUT_DIR/hidden_states/hs_{i}.safetensors   {"hidden_states" [seq, n, H] model dtype, "token_ids" int64 [seq]}
    OUT_DIR/token_freq.pt               dict[int token_id -> int count] over tokens with loss_mask == 1

speculators' ArrowDataset(datapath=OUT_DIR) reads row i and hidden_states/hs_i.safetensors (its default
hidden_states_path) and requires token_ids == input_ids. The table is written with pyarrow directly,
streamed in batches, so exporting needs neither `datasets` nor memory for all samples.
"""

from __future__ import annotations

import os
import re
import secrets
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from hsextract.atomic import fsync_dir, fsync_path, write_json_atomic
from hsextract.dataset import HiddenStateDataset
from hsextract.export.common import atomic_write
from hsextract.prepare.vocab import save_token_freq

ARROW_FILE = "data-00000-of-00001.arrow"
SCHEMA = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64())])
# rows of the table written at once: up to this many samples or tokens (one sample can hold 128k)
BATCH_ROWS = 512
BATCH_TOKENS = 1 << 20


def _batch(rows: list[tuple[np.ndarray, np.ndarray]]) -> pa.RecordBatch:
    return pa.record_batch([
        pa.array([r[0] for r in rows], pa.list_(pa.int64())),
        pa.array([r[1] for r in rows], pa.list_(pa.int64())),
        pa.array([len(r[0]) for r in rows], pa.int64()),
    ], schema=SCHEMA)


def _save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file writes from the tensors' memory (`save` would first copy the whole file into bytes);
    into the export's temporary folder, which becomes the export at once (export: atomic_dir), so no temp here.
    Its error of a failed write (a full disk) is an OSError naming the file, as every other writer's."""
    try:
        save_file(tensors, path)
    except SafetensorError as e:  # not an OSError, and names no file: "I/O error: ... (os error 28)"
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), os.fspath(path)) from e
    fsync_path(path)


def export_speculators_safetensors(ds: HiddenStateDataset, out_dir: Path) -> dict[str, Any]:
    hs_dir = out_dir / "hidden_states"
    hs_dir.mkdir()
    freq: Counter[int] = Counter()
    tokens = 0
    n = 0

    def write_table(f: Any) -> None:
        nonlocal tokens, n
        rows: list[tuple[np.ndarray, np.ndarray]] = []
        with pa.ipc.new_stream(f, SCHEMA) as w:
            for idx, s in enumerate(ds):
                ids, mask = s["input_ids"], s["loss_mask"]
                stacked = torch.stack(s["hidden_states"], dim=1)  # [seq, n, H]
                _save_file({"hidden_states": stacked, "token_ids": ids.contiguous()},
                           hs_dir / f"hs_{idx}.safetensors")
                del stacked
                rows.append((ids.to(torch.int64).numpy(), mask.to(torch.int64).numpy()))
                if len(rows) == BATCH_ROWS or sum(len(r[0]) for r in rows) >= BATCH_TOKENS:
                    w.write_batch(_batch(rows))
                    rows.clear()
                u, c = ids[mask.to(torch.bool)].unique(return_counts=True)
                freq.update(dict(zip(u.tolist(), c.tolist(), strict=True)))
                tokens += int(ids.numel())
                n = idx + 1
            if rows:
                w.write_batch(_batch(rows))

    atomic_write(out_dir / ARROW_FILE, write_table)
    fsync_dir(hs_dir)  # the files' names: atomic_dir syncs the export's own folder, not this one
    write_json_atomic(out_dir / "dataset_info.json", {}, indent=2)
    write_json_atomic(out_dir / "state.json", {
        "_data_files": [{"filename": ARROW_FILE}],
        "_fingerprint": secrets.token_hex(8),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": "torch",
        "_output_all_columns": False,
        "_split": None,
    }, indent=2)
    save_token_freq(freq, out_dir / "token_freq.pt")
    return {"num_samples": n, "num_tokens": tokens, "data_path": "."}
