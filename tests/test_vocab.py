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

from hsextract.prepare.vocab import save_token_freq, token_freq


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
    assert [p.name for p in tmp_path.iterdir()] == ["token_freq.pt"]  # no temp file left


@pytest.mark.parametrize("seed,n_seen,draft,target", [(0, 500, 64, 1000), (1, 20, 64, 1000), (2, 64, 64, 64),
                                                      (3, 300, 100, 300)])
def test_speculators_builds_its_draft_vocabulary_from_our_file(seed, n_seen, draft, target, tmp_path):
    """token_freq.pt as written, loaded as speculators loads it, into its own d2t / t2d builder: the draft
    vocabulary is the `draft` most frequent trained ids (ties to the smaller id), filled with the smallest unseen."""
    reference = _speculators_fn()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target, generator=g)[:n_seen].tolist()
    counts = torch.randint(1, 6, (n_seen,), generator=g).tolist()  # many ties
    save_token_freq(dict(zip(ids, counts, strict=True)), tmp_path / "token_freq.pt")
    d2t, t2d = reference(torch.load(tmp_path / "token_freq.pt", weights_only=True), draft_vocab_size=draft,
                         target_vocab_size=target)
    chosen = [t for t, _ in sorted(zip(ids, counts, strict=True), key=lambda tc: (-tc[1], tc[0]))][:draft]
    chosen += [t for t in range(target) if t not in set(chosen)][:draft - len(chosen)]
    assert (torch.arange(draft) + d2t).tolist() == sorted(chosen)
    assert t2d.nonzero().flatten().tolist() == sorted(chosen)
