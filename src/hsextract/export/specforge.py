"""SpecForge offline layout: per-sample torch.save files grouped 2000 to a folder, as prepare_hidden_states.py writes.

    OUT_DIR/rows_{g}-{g + 2000}/data_{idx}.ckpt
        {"input_ids" int64 [seq], "loss_mask" int64 [seq],
         "hidden_state" [1, seq, H] (the final tensor),
         "aux_hidden_state" [1, seq, n_aux * H] (aux layers concatenated)}

g = (idx // 2000) * 2000; the last folder's name ends at g + 2000 too, as SpecForge names it (its
scripts/prepare_hidden_states.py: `rows_{group_start}-{group_start + group_size}`), so its resume check finds the files.
SpecForge's hidden_state is post-norm: pre_norm data is written through the final norm its shards record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hsextract.dataset import HiddenStateDataset
from hsextract.export.common import own_storage, save_torch
from hsextract.extract.final_norm import FinalNorm

GROUP_SIZE = 2000


def group_dir(idx: int) -> str:
    start = (idx // GROUP_SIZE) * GROUP_SIZE
    return f"rows_{start}-{start + GROUP_SIZE}"


def export_specforge(ds: HiddenStateDataset, out_dir: Path, final_norm: FinalNorm | None = None) -> dict[str, Any]:
    """`final_norm`: applied to the last tensor (pre_norm data to SpecForge's post-norm hidden_state)."""
    tokens = 0
    for idx, s in enumerate(ds):
        folder = out_dir / group_dir(idx)
        folder.mkdir(exist_ok=True)
        hs = s["hidden_states"]
        final = hs[-1] if final_norm is None else final_norm.apply(hs[-1])
        path = folder / f"data_{idx}.ckpt"
        save_torch(path, {
            "input_ids": own_storage(s["input_ids"]),
            "loss_mask": own_storage(s["loss_mask"]),
            "hidden_state": own_storage(final).unsqueeze(0),
            "aux_hidden_state": torch.cat(hs[:-1], dim=-1).unsqueeze(0),
        })
        tokens += int(s["input_ids"].numel())
    return {"num_samples": len(ds), "num_tokens": tokens, "data_path": "."}
