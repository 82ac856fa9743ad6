import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def shard_metadata(**over):
    meta = dict(
        model="test-model", engine="transformers", engine_version="test", aux_layers=[1, 2, 3],
        final_state="post_norm", hidden_size=16, dtype="bfloat16", config_hash="c0", tokenizer_hash="t0",
        chat_template_hash="h0",
    )
    meta.update(over)
    return meta


def make_sample(seq, hidden=16, n=4, dtype=torch.bfloat16, seed=0, trained=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (seq,), generator=g)
    mask = (torch.rand(seq, generator=g) > 0.5).long()
    if trained:
        mask[-1] = 1
    else:
        mask.zero_()
    hs = [(torch.randn(seq, hidden, generator=g) * (k + 1)).to(dtype) for k in range(n)]
    return ids, hs, mask


@pytest.fixture
def meta():
    return shard_metadata()
