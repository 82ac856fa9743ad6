"""token_freq and d2t/t2d, compared with speculators 0.4.0's own function (its module loaded from the wheel)."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
import types
import zipfile

import pytest
import torch

from hsextract.prepare.vocab import build_vocab_mapping, load_token_freq, save_token_freq, token_freq


def _speculators_fn():
    """speculators 0.4.0 build_vocab_mappings_from_distribution, from an installed copy or a wheel
    (HSX_SPECULATORS_WHEEL, or `pip download --no-deps speculators==0.4.0 -d /tmp/specdl`)."""
    src = None
    spec = importlib.util.find_spec("speculators")  # does not import the package (heavy deps)
    if spec and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], "train", "vocab_mapping.py")
        if os.path.exists(path):
            src = open(path).read()
    if src is None:
        wheels = [os.environ.get("HSX_SPECULATORS_WHEEL", "")] + glob.glob("/tmp/specdl/speculators-0.4.0-*.whl")
        wheels = [w for w in wheels if w and os.path.exists(w)]
        if not wheels:
            pytest.skip("speculators 0.4.0 not available (pip download --no-deps speculators==0.4.0 -d /tmp/specdl)")
        with zipfile.ZipFile(wheels[0]) as z:
            src = z.read("speculators/train/vocab_mapping.py").decode()
    saved = sys.modules.get("datasets")
    if saved is None:  # only used for a type hint there
        stub = types.ModuleType("datasets")
        stub.Dataset = object
        sys.modules["datasets"] = stub
    try:
        mod = types.ModuleType("spec_vocab_mapping")
        exec(compile(src, "speculators/train/vocab_mapping.py", "exec"), mod.__dict__)
    finally:
        if saved is None:
            del sys.modules["datasets"]
    return mod.build_vocab_mappings_from_distribution


def test_token_freq_counts_trained_positions_only():
    freq = token_freq([([5, 6, 7, 5], [0, 1, 1, 1]), ([7, 9], [1, 0])])
    assert freq == {6: 1, 7: 2, 5: 1}


def test_token_freq_file_round_trip(tmp_path):
    save_token_freq({3: 10, 1: 2}, tmp_path / "token_freq.pt")
    raw = torch.load(tmp_path / "token_freq.pt", weights_only=True)
    assert raw == {3: 10, 1: 2} and all(type(k) is int and type(v) is int for k, v in raw.items())
    assert load_token_freq(tmp_path / "token_freq.pt") == {3: 10, 1: 2}
    assert [p.name for p in tmp_path.iterdir()] == ["token_freq.pt"]  # no temp file left


def test_build_vocab_mapping_values():
    d2t, t2d = build_vocab_mapping({7: 5, 3: 5, 9: 1, 2: 8}, target_vocab_size=12, draft_vocab_size=3)
    # top 3: 2 (8), then 3 and 7 (5 each, smaller id first); sorted -> [2, 3, 7]
    assert d2t.tolist() == [2 - 0, 3 - 1, 7 - 2] and d2t.dtype == torch.long
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [2, 3, 7]
    d2t, t2d = build_vocab_mapping({5: 1}, target_vocab_size=8, draft_vocab_size=4)  # filled with 0, 1, 2
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 2, 5]


@pytest.mark.parametrize("seed,n_seen,draft,target", [(0, 500, 64, 1000), (1, 20, 64, 1000), (2, 64, 64, 64),
                                                      (3, 300, 100, 300)])
def test_equal_to_speculators(seed, n_seen, draft, target):
    reference = _speculators_fn()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target, generator=g)[:n_seen].tolist()
    counts = torch.randint(1, 6, (n_seen,), generator=g).tolist()  # many ties
    freq = dict(zip(ids, counts, strict=True))
    d2t, t2d = build_vocab_mapping(freq, target_vocab_size=target, draft_vocab_size=draft)
    rd2t, rt2d = reference(freq, draft_vocab_size=draft, target_vocab_size=target)
    assert torch.equal(d2t, rd2t) and torch.equal(t2d, rt2d)
