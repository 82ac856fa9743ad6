"""HiddenStateDataset.stream: every sample exactly once per epoch, in an order fixed by (seed, epoch), split
among ranks and DataLoader workers, decoded ahead on threads; errors arrive at their sample."""

import copy
import threading

import numpy as np
import pytest
import torch
from conftest import make_sample, shard_metadata
from torch.utils.data import DataLoader

from hsextract import open_dataset
from hsextract.errors import CorruptShardError, ShardError
from hsextract.shard import ShardReader, ShardWriter

N = 11  # samples over two shards (6 + 5): not a multiple of the worker or rank counts used below


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream")
    paths = []
    for chunk, ks in enumerate((range(6), range(6, N))):
        path = folder / f"chunk-{chunk:05d}.hss"
        with ShardWriter(path, shard_metadata(chunk=chunk)) as w:
            for k in ks:
                w.add(*make_sample(3 + k, seed=k), sample_id=f"s{k}")
        paths.append(path)
    return paths


def sample_no(s):
    """Which sample this is: sample k has 3 + k tokens (a batch of one has a leading dimension)."""
    return s["input_ids"].shape[-1] - 3


def check_sample(s):
    ids, hs, mask = make_sample(3 + sample_no(s), seed=sample_no(s))
    assert torch.equal(s["input_ids"].reshape(-1), ids) and torch.equal(s["loss_mask"].reshape(-1), mask)
    assert all(torch.equal(a.reshape(b.shape), b) for a, b in zip(s["hidden_states"], hs, strict=True))


@pytest.mark.parametrize("readahead", [0, 1, 3])
def test_one_process_yields_the_permutation_of_seed_and_epoch(shards, readahead):
    stream = open_dataset(shards, decode_threads=2).stream(seed=7, readahead=readahead)
    perm = np.random.default_rng([7, 0]).permutation(N)
    got = list(stream)
    assert [sample_no(s) for s in got] == perm.tolist()
    for s in got:
        check_sample(s)
    # the next pass is epoch 1: another order, the same samples
    second = [sample_no(s) for s in stream]
    assert second == np.random.default_rng([7, 1]).permutation(N).tolist() and second != perm.tolist()
    stream.set_epoch(0)
    assert [sample_no(s) for s in stream] == perm.tolist()


def test_unshuffled_is_dataset_order(shards):
    assert [sample_no(s) for s in open_dataset(shards).stream(shuffle=False)] == list(range(N))


def test_dataloader_workers_share_each_epoch_and_persistent_ones_move_on(shards):
    stream = open_dataset(shards, decode_threads=2).stream(seed=3, readahead=2)
    loader = DataLoader(stream, batch_size=1, num_workers=3, persistent_workers=True,
                        multiprocessing_context="fork", timeout=120)
    assert len(loader) == N
    epochs = []
    for _ in range(3):
        got = list(loader)
        for s in got:
            check_sample(s)
        epochs.append([sample_no(s) for s in got])
    for e, order in enumerate(epochs):
        assert sorted(order) == list(range(N))  # each sample exactly once
        # worker k yields perm[k::3]; the loader takes one from each in turn, which gives back perm itself
        assert order == np.random.default_rng([3, e]).permutation(N).tolist()
    assert epochs[0] != epochs[1] != epochs[2]


def test_ranks_take_disjoint_equal_shares(shards):
    ds = open_dataset(shards)
    shares = [[sample_no(s) for s in ds.stream(seed=1, rank=r, world_size=3)] for r in range(3)]
    assert [len(s) for s in shares] == [N // 3] * 3 == [len(ds.stream(rank=r, world_size=3)) for r in range(3)]
    every = sum(shares, [])
    assert len(set(every)) == len(every) == 3 * (N // 3)
    perm = np.random.default_rng([1, 0]).permutation(N)[: 3 * (N // 3)]
    assert shares[1] == perm[1::3].tolist()


def test_stopping_early_leaves_no_threads(shards):
    before = {t.name for t in threading.enumerate()}
    it = iter(open_dataset(shards).stream(readahead=3))
    next(it)
    assert {t.name.split("_")[0] for t in threading.enumerate()} >= {"hsx-ahead", "hsx-hint"}
    it.close()
    assert {t.name for t in threading.enumerate() if t.name.startswith(("hsx-ahead", "hsx-hint"))} <= before


def test_a_damaged_sample_is_an_error_when_its_turn_comes(shards, tmp_path):
    bad = tmp_path / "bad.hss"
    data = bytearray(shards[0].read_bytes())
    data[ShardReader(shards[0]).index["offsets"][2] + 60] ^= 0xFF  # inside sample 2's payload
    bad.write_bytes(bytes(data))
    stream = open_dataset([bad, shards[1]]).stream(shuffle=False, readahead=2)
    got = []
    with pytest.raises(CorruptShardError, match=r"bad\.hss.*sample 2"):
        for s in stream:
            got.append(sample_no(s))
    assert got == [0, 1]


@pytest.mark.parametrize(("readahead", "prefetch"), [(0, 2), (2, 3), (3, 0)])
def test_the_disk_is_asked_for_the_next_records_in_the_epoch_order(shards, readahead, prefetch):
    """prefetch: when sample k of the order is handed out, the records of at least the next `prefetch` samples have
    been asked of the disk, and not more than those the decode threads hold besides; each once, in order."""
    ds = open_dataset(shards, decode_threads=2)
    asked, moved = [], threading.Condition()
    real = ds.prefetch

    def record(i):
        real(i)
        with moved:
            asked.append(i)
            moved.notify_all()

    ds.prefetch = record
    stream = ds.stream(seed=3, readahead=readahead, prefetch=prefetch)
    order = np.random.default_rng([3, 0]).permutation(N).tolist()
    for k, s in enumerate(stream):
        assert sample_no(s) == order[k]
        check_sample(s)
        with moved:  # the hints run on a thread of their own: wait for those already asked for
            least = min(N, k + 1 + prefetch)
            assert not prefetch or moved.wait_for(lambda n=least: len(asked) >= n, timeout=60)
            assert len(asked) <= (min(N, k + max(readahead, 1) + prefetch) if prefetch else 0)
    assert asked == (order if prefetch else [])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"readahead": -1}, "readahead -1: must be an integer >= 0 (samples decoded ahead)"),
    ({"readahead": 1.5}, "readahead 1.5: must be an integer >= 0 (samples decoded ahead)"),
    ({"prefetch": -2}, "prefetch -2: must be an integer >= 0 (samples whose records are asked of the disk ahead)"),
    ({"rank": 2, "world_size": 2}, "rank 2 of world_size 2: need 0 <= rank < world_size"),
    ({"rank": 0, "world_size": 0}, "rank 0 of world_size 0: need 0 <= rank < world_size"),
])
def test_bad_arguments_say_what(shards, kwargs, message):
    with pytest.raises(ShardError) as e:
        open_dataset(shards).stream(**kwargs)
    assert str(e.value) == message




@pytest.mark.parametrize("batch_size", [None, 1])
def test_uncollated_samples_leave_a_worker_in_shared_memory(shards, batch_size):
    """stream(batch_size=None) for a loader that does not collate: a worker's samples are decoded into shared
    memory, so sending them copies nothing; with batch_size=1 they are ordinary memory (a collating loader copies
    them into a fresh shared block anyway)."""
    def as_sent(s):  # the loader's per-sample conversion in the worker, just before the sample is sent
        return sample_no(s), [t.is_shared() for t in (s["input_ids"], s["loss_mask"], *s["hidden_states"])], s

    stream = open_dataset(shards, decode_threads=2).stream(seed=5, batch_size=batch_size)
    loader = DataLoader(stream, batch_size=None, num_workers=2, collate_fn=as_sent, multiprocessing_context="fork",
                        timeout=120)
    got = list(loader)
    assert [k for k, _, _ in got] == np.random.default_rng([5, 0]).permutation(N).tolist()
    assert all(all(shared) == (batch_size is None) and len(set(shared)) == 1 for _, shared, _ in got)
    for _, _, s in got:
        check_sample(s)


def test_workers_that_are_not_persistent_follow_set_epoch(shards):
    stream = open_dataset(shards).stream(seed=4, readahead=1)
    loader = DataLoader(stream, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=120)
    orders = {}
    for e in (0, 1, 1, 0):
        stream.set_epoch(e)
        order = [sample_no(s) for s in loader]
        assert order == np.random.default_rng([4, e]).permutation(N).tolist()
        orders.setdefault(e, order)
    assert orders[0] != orders[1]


def test_a_resumed_epoch_delivers_the_rest_in_the_same_order(shards):
    stream = open_dataset(shards).stream(seed=9, readahead=2)
    stream.set_epoch(2, start=4)
    assert len(stream) == N - 4
    loader = DataLoader(stream, batch_size=None, num_workers=3, persistent_workers=True,
                        multiprocessing_context="fork", timeout=120)
    whole = np.random.default_rng([9, 2]).permutation(N).tolist()
    # the first 4 samples of epoch 2 were delivered before the checkpoint; with 3 workers the rest comes in order
    assert [sample_no(s) for s in loader] == whole[4:]
    assert [sample_no(s) for s in loader] == np.random.default_rng([9, 3]).permutation(N).tolist()  # whole again
    # freed now: in the reference cycle of the ExceptionInfo below (frame -> e -> traceback -> frame), only the
    # garbage collector would free it, and a persistent loader's workers then take 5 s each to stop (torch's)
    del loader
    with pytest.raises(ShardError) as e:
        stream.set_epoch(0, start=N + 1)
    assert str(e.value) == f"start {N + 1}: must be an integer from 0 to the {N} samples an epoch of this rank holds"


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_set_epoch_reaches_persistent_workers_that_already_run(shards, context):
    """A peek at the first sample starts the persistent workers; set_epoch after it (a resume, or epoch e) still
    decides the next pass, and len() counts the resumed epoch once, whole epochs after it."""
    stream = open_dataset(shards).stream(seed=5, readahead=1, batch_size=None)
    loader = DataLoader(stream, batch_size=None, num_workers=2, persistent_workers=True,
                        multiprocessing_context=context, timeout=120)
    perm = [np.random.default_rng([5, e]).permutation(N).tolist() for e in range(4)]
    assert sample_no(next(iter(loader))) == perm[0][0]  # the peek: the workers run, their pass left unfinished
    stream.set_epoch(1, start=3)
    assert len(loader) == N - 3
    assert [sample_no(s) for s in loader] == perm[1][3:]
    assert len(loader) == N
    assert [sample_no(s) for s in loader] == perm[2]  # the epoch after it, whole
    stream.set_epoch(0)
    assert [sample_no(s) for s in loader] == perm[0]
    assert [sample_no(s) for s in loader] == perm[1]
    del loader


def test_a_worker_that_starts_a_peeks_pass_after_set_epoch_leaves_len_to_the_resumed_epoch(shards):
    """What a loaded machine does to the test above, without the race: a persistent worker (a copy of the stream
    sharing its state, made before set_epoch) comes to the peek's pass only after set_epoch(1, start=3). That pass
    keeps the epoch it was made for, and the resumed epoch has not begun: len() still counts from its start."""
    stream = open_dataset(shards).stream(seed=5, readahead=0, batch_size=None)
    late = copy.copy(stream)  # shares _state (shared memory in a real worker), its own generation and passes
    stream.set_epoch(1, start=3)
    perm = [np.random.default_rng([5, e]).permutation(N).tolist() for e in range(2)]
    assert [sample_no(s) for s in late] == perm[0]  # the peek's pass: epoch 0, whole
    assert len(stream) == N - 3
    assert [sample_no(s) for s in stream] == perm[1][3:]
    assert len(stream) == N


def test_ranks_must_be_named_under_torch_distributed(shards, monkeypatch):
    from hsextract import dataset

    assert dataset.distributed_ranks() == 1  # no process group here
    ds = open_dataset(shards)
    monkeypatch.setattr(dataset, "distributed_ranks", lambda: 4)
    with pytest.raises(ShardError) as e:
        ds.stream()
    assert str(e.value) == (
        "torch.distributed runs 4 ranks: pass stream(rank=..., world_size=...), the data-parallel rank and size "
        "(under plain DDP or FSDP dist.get_rank() and dist.get_world_size()), or world_size=1 for every rank to "
        "read every sample")
    assert len(ds.stream(rank=1, world_size=4)) == N // 4 and len(ds.stream(rank=0, world_size=1)) == N
    with pytest.raises(ShardError, match=r"^rank 1 of world_size None: give both or neither$"):
        ds.stream(rank=1)
    monkeypatch.setattr(dataset, "distributed_ranks", lambda: 1)
    assert len(ds.stream()) == N


@pytest.mark.parametrize("batch_size", [2, 3])
def test_batches_come_in_the_epoch_order_and_resume_after_any_batch(shards, batch_size):
    stream = open_dataset(shards).stream(seed=6, batch_size=batch_size)
    loader = DataLoader(stream, batch_size=batch_size, num_workers=2, multiprocessing_context="fork", timeout=120,
                        collate_fn=lambda batch: [sample_no(s) for s in batch])
    perm = np.random.default_rng([6, 0]).permutation(N).tolist()
    batches = list(loader)
    assert batches == [perm[a:a + batch_size] for a in range(0, N, batch_size)]
    stream.set_epoch(0, start=2 * batch_size)  # two batches had been delivered
    assert sum(loader, []) == perm[2 * batch_size:]
    with pytest.raises(ShardError,
                       match=r"^batch_size 0: must be the DataLoader's batch size, an integer >= 1 or None$"):
        open_dataset(shards).stream(batch_size=0)



@pytest.fixture(scope="module")
def shared_shards(tmp_path_factory):
    """Two version-2 shards of tests/hostile.py's FAMILY: per shard a family of five (sample 0 and the four that
    take rows from it, two of them through 1 or 2) and a sample alone."""
    from hostile import family, shared_shard

    folder = tmp_path_factory.mktemp("shared")
    return [shared_shard(folder / f"chunk-{k:05d}.hss", family(seed=k)) for k in range(2)]


@pytest.mark.parametrize("readahead", [0, 3])
def test_a_family_stream_reads_each_ancestor_record_once_and_yields_ds_i(shared_shards, readahead):
    """group="family": every sample once per epoch, byte-equal to ds[i]; the records samples take rows from are
    read once per pass (two per shard: samples 0 and 1), where reading each sample alone reads them at every use
    (sample 1 for 2 and 4; sample 0 for 1, 2, 3 and 4: six per shard); ancestors decode only the rows they supply."""
    ds = open_dataset(shared_shards)
    assert ds.families() == [[0, 1, 2, 3, 4], [5], [6, 7, 8, 9, 10], [11]]
    assert [s[0] for s in ds.readers[0].supplies(4)] == [1, 0] and ds.readers[0].supplies(4)[0][1:] == (5, 6)
    for cache_bytes, reads in ((1 << 20, 4), (0, 12)):
        stream = ds.stream(seed=3, readahead=readahead, group="family", window=2, cache_bytes=cache_bytes)
        order = stream.order(0)
        assert sorted(order.tolist()) == list(range(12))
        got = list(stream)
        if cache_bytes or not readahead:
            assert stream.records_read == reads
        else:  # nothing kept, but decode threads needing a record at once share its one read: how often is timing
            assert 4 <= stream.records_read <= reads
        for i, s in zip(order, got, strict=True):
            want = ds[int(i)]
            assert torch.equal(s["input_ids"], want["input_ids"]) and torch.equal(s["loss_mask"], want["loss_mask"])
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(s["hidden_states"], want["hidden_states"], strict=True))
    # window 1: each family's samples are consecutive; windows of two families: a family stays within its window
    fams = {i: f for f, members in enumerate(ds.families()) for i in members}
    runs = [fams[int(i)] for i in ds.stream(seed=5, group="family", window=1).order(0)]
    assert [f for k, f in enumerate(runs) if k == 0 or runs[k - 1] != f] == sorted(set(runs), key=runs.index)
    assert sorted(ds.stream(group="family", shuffle=False).order(0).tolist()) == list(range(12))


def test_family_ranks_take_contiguous_disjoint_equal_shares(shared_shards):
    ds = open_dataset(shared_shards)
    full = ds.stream(seed=1, group="family", window=2).order(4)
    shares = [ds.stream(seed=1, group="family", window=2, rank=r, world_size=5).order(4) for r in range(5)]
    assert [len(s) for s in shares] == [2] * 5
    assert np.concatenate(shares).tolist() == full[:10].tolist()
    with pytest.raises(ShardError, match=r"^group 'turn': must be None \(samples one by one\) or 'family'$"):
        ds.stream(group="turn")
