"""speculators 0.3/0.4 "v1" layout: one torch.save file per sample plus the files 0.4 writes beside them.

    OUT_DIR/data/data_{idx}.pt          {"input_ids" int64 [seq], "hidden_states" [bf16 [seq, H]] * n,
                                         "loss_mask" int64 [seq]}
    OUT_DIR/data/sample_lengths.json    {"idx": seq, ...}, json.dump(indent=2) of an int-keyed dict, as 0.4 writes it
    OUT_DIR/data/data_config.json       the DataGenerationConfig "2.0" fields, filled from the shard metadata
    OUT_DIR/token_freq.pt               dict[int token_id -> int count] over tokens with loss_mask == 1

token_freq.pt sits one level up on purpose: speculators' Eagle3SampleFileDataset loads every file under its
data path whose name ends in "pt", so a token_freq.pt inside data/ would be read as a sample and fail.
(speculators 0.4 itself writes it to the working directory, outside its output folder.)
Point the trainer's data path at OUT_DIR/data and its token-frequency path at OUT_DIR/token_freq.pt.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from hsextract import __version__, layers
from hsextract.atomic import write_json_atomic
from hsextract.dataset import HiddenStateDataset
from hsextract.export.common import own_storage, save_torch
from hsextract.prepare.vocab import save_token_freq


def _version_of(package: str, meta: dict[str, Any]) -> str | None:
    """The version of `package` in the shard's engine_version ("transformers 5.25.0 / torch 2.13.0+cpu") when it is
    the shard's engine; None otherwise."""
    found = re.search(rf"\b{package} (\S+)", str(meta.get("engine_version") or ""))
    return found[1] if found and meta.get("engine") == package else None


def data_config(meta: dict[str, Any], num_samples: int, max_len: int) -> dict[str, Any]:
    """speculators 0.4's DataGenerationConfig (version "2.0") with what the shards know; unknowns are null."""
    n_layers = meta.get("num_hidden_layers")
    # speculators 0.4's data generation captures after layer i (custom_worker.py): its layer_ids are layer outputs,
    # the last one the last decoder layer; meta's aux_layers are hidden_states ids (dataset.metadata)
    layer_ids = layers.to_layer_output(meta["aux_layers"]) + [n_layers - 1 if isinstance(n_layers, int) else None]
    hidden, n = meta["hidden_size"], meta["num_hidden_tensors"]
    return {
        "version": "2.0",
        "generated_at": datetime.now(UTC).isoformat(),
        "speculators_version": "0.4.0",
        "reproducibility": {
            "command": f"hsextract export --format speculators-v1 (hsextract {__version__})",
            "package_versions": {
                "torch": torch.__version__,
                "vllm": _version_of("vllm", meta),
                "transformers": _version_of("transformers", meta),
                "speculators": None,
            },
            "gpu": meta.get("gpu"),
        },
        "model": {
            "target_model_path": meta["model"],
            "tensor_parallel_size": meta.get("tensor_parallel_size"),
            "gpu_memory_utilization": None,
            "hidden_size": hidden,
        },
        "data": {
            "train_data_path": meta.get("source"),
            "seq_length": meta.get("max_seq_len", max_len),
            "max_samples": None,
            "num_samples": num_samples,
            "seed": meta.get("seed"),
            "chat_template_note": f"chat template hash {meta.get('chat_template_hash')}",
        },
        "hidden_states": {
            "layer_ids": layer_ids,
            "description": (f"{layers.describe(meta['aux_layers'])} (layer_ids are layer outputs, as speculators "
                            f"0.4 records them), then the last decoder layer ({meta['final_state']}); captured by "
                            f"hsextract with engine {meta.get('engine')}. A drafter served by vLLM takes "
                            f"eagle_aux_hidden_state_layer_ids {list(meta['aux_layers'])} (layers.json)"),
        },
        "generation": {"cache_dir": None},
        "format": {
            "file_pattern": "data_{idx}.pt",
            "schema": {
                "input_ids": {"dtype": "torch.long", "shape": "[seq_len]", "description": "Tokenized input sequence"},
                "hidden_states": {
                    "dtype": f"list[torch.{meta['dtype']}]",
                    "shape": f"list of [seq_len, {hidden}]",
                    "num_tensors": n,
                    "description": f"Hidden states from {n} layers",
                },
                "loss_mask": {"dtype": "torch.long", "shape": "[seq_len]",
                              "description": "1 for assistant tokens to train on, 0 elsewhere"},
            },
        },
        "hsextract": {k: meta.get(k) for k in ("model", "engine", "engine_version", "aux_layers", "final_state",
                                                "config_hash", "tokenizer_hash", "chat_template_hash")},
    }


def export_speculators_v1(ds: HiddenStateDataset, out_dir: Path) -> dict[str, Any]:
    data_dir = out_dir / "data"
    data_dir.mkdir()
    lengths: dict[int, int] = {}
    freq: Counter[int] = Counter()
    for idx, s in enumerate(ds):
        save_torch(data_dir / f"data_{idx}.pt", {
            "input_ids": own_storage(s["input_ids"]),
            "hidden_states": [own_storage(h) for h in s["hidden_states"]],
            "loss_mask": own_storage(s["loss_mask"]),
        })
        lengths[idx] = int(s["input_ids"].numel())
        ids, counts = s["input_ids"][s["loss_mask"].to(torch.bool)].unique(return_counts=True)
        freq.update(dict(zip(ids.tolist(), counts.tolist(), strict=True)))
    n = len(lengths)
    write_json_atomic(data_dir / "sample_lengths.json", lengths, indent=2)
    write_json_atomic(data_dir / "data_config.json", data_config(ds.metadata, n, max(lengths.values(), default=0)),
                      indent=2)
    save_token_freq(freq, out_dir / "token_freq.pt")
    return {"num_samples": n, "num_tokens": sum(lengths.values()), "data_path": "data",
            "token_freq_path": "token_freq.pt"}
