"""Open files: a process keeps at most MAX_OPEN shard files open, whatever the shards of its datasets, and a file
reopened is the one the reader's index was read from, or the read is refused."""

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import make_sample, shard_metadata
from torch.utils.data import DataLoader

import hsextract
from hsextract import open_dataset
from hsextract.errors import CorruptShardError, ShardError
from hsextract.shard import ShardReader, ShardWriter
from hsextract.shard import reader as reader_module

REPLACED = "replaced or modified on disk since it was opened"


def write_shards(folder: Path, n: int, per: int = 2) -> list[Path]:
    """n shards of `per` samples; sample k of the dataset has 3 + k % 7 tokens and seed k."""
    folder.mkdir(exist_ok=True)
    paths = []
    for s in range(n):
        path = folder / f"chunk-{s:05d}.hss"
        with ShardWriter(path, shard_metadata(chunk=s)) as w:
            for k in range(s * per, (s + 1) * per):
                w.add(*make_sample(3 + k % 7, seed=k), sample_id=f"s{k}")
        paths.append(path)
    return paths


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
            and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                    for x, y in zip(a["hidden_states"], b["hidden_states"], strict=True)))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


LOW_LIMIT = textwrap.dedent("""
    import os, resource, sys
    import torch
    from torch.utils.data import DataLoader
    from hsextract import open_dataset
    from hsextract.shard import reader

    folder, expected, spare = sys.argv[1], torch.load(sys.argv[2]), int(sys.argv[3])
    limit = len(os.listdir("/proc/self/fd")) + reader.MAX_OPEN + spare
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    def shard_files():
        return sum(os.readlink(f"/proc/self/fd/{f}").endswith(".hss") for f in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{f}"))

    def same(a, b):
        return (torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
                and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                        for x, y in zip(a["hidden_states"], b["hidden_states"], strict=True)))

    ds = open_dataset(folder)
    assert len(ds.readers) > limit and len(ds) == len(expected), (len(ds.readers), limit)
    assert shard_files() <= reader.MAX_OPEN, shard_files()
    assert all(same(ds[i], expected[i]) for i in range(len(ds))), "ds[i]"
    assert all(same(ds[i], expected[i]) for i in reversed(range(len(ds)))), "ds[i], backwards"
    stream = ds.stream(seed=3, readahead=3, prefetch=4)
    order = stream.order(0).tolist()
    got = list(stream)
    assert len(got) == len(order) and all(same(s, expected[i]) for s, i in zip(got, order)), "stream"
    # compared as they come: a received tensor keeps a descriptor open while it lives (torch's file_descriptor sharing)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=120)
    n = 0
    for i, s in enumerate(loader):
        assert same(s, expected[i]), ("map-style, 2 forked workers", i)
        n += 1
    assert n == len(ds)
    stream = ds.stream(seed=4, batch_size=None)
    order = stream.order(0).tolist()
    loader = DataLoader(stream, batch_size=None, num_workers=2, multiprocessing_context="spawn", timeout=120)
    n = 0
    for k, s in enumerate(loader):
        assert same(s, expected[order[k]]), ("stream, 2 spawned workers", k)
        n += 1
    assert n == len(ds)
    assert shard_files() <= reader.MAX_OPEN, shard_files()
    print("ok", len(ds.readers), "shards under a limit of", limit, "open files")
""")


def test_more_shards_than_the_open_file_limit_read_alike(tmp_path):
    """More shards than the soft limit of open files allows (MAX_OPEN + 48 above what the process had open): the
    dataset opens, and every sample read, by index, in a stream, through forked and spawned DataLoader workers,
    equals the sample read from its shard alone. Before the cache, opening failed with EMFILE."""
    shards = write_shards(tmp_path / "shards", reader_module.MAX_OPEN + 160)
    expected = []
    for path in shards:
        r = ShardReader(path)
        expected += [r[j] for j in range(len(r))]
        r.close()
    assert same(expected[9], dict(zip(("input_ids", "hidden_states", "loss_mask"), make_sample(5, seed=9),
                                      strict=True)))
    torch.save(expected, tmp_path / "expected.pt")
    src, tests = Path(hsextract.__file__).parents[1], Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(tests), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", LOW_LIMIT, str(tmp_path / "shards"), str(tmp_path / "expected.pt"),
                          "48"], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert out.returncode == 0 and out.stdout.startswith("ok "), out.stderr[-3000:]


def test_the_cache_holds_at_most_max_open_files(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_module, "MAX_OPEN", 4)
    shards = write_shards(tmp_path, 20)
    before = open_fds()
    ds = open_dataset(shards)
    assert open_fds() - before <= 4 and len(reader_module._HANDLES) <= 4
    for i in range(len(ds)):
        ds[i]
        ds.prefetch(len(ds) - 1 - i)
    assert open_fds() - before <= 4 and len(reader_module._HANDLES) <= 4
    # the files last used are kept: shards 18 (ds[37]), 1 (prefetch(2)), 19 (ds[39]) and 0 (prefetch(0))
    assert list(reader_module._HANDLES) == [ds.readers[k]._key for k in (18, 1, 19, 0)]
    del ds
    assert not reader_module._HANDLES and open_fds() <= before  # a reader that goes closes its file


def test_a_file_in_use_is_not_closed_under_its_reader(tmp_path, monkeypatch):
    """A read (or a prefetch) on one thread holds its file while other threads' reads fill the cache: it is
    closed once released, never while in use (its number could be reused by another file's open)."""
    monkeypatch.setattr(reader_module, "MAX_OPEN", 1)
    ds = open_dataset(write_shards(tmp_path, 6))
    first = ds.readers[0]
    with first._file() as fd:
        for i in range(2, len(ds)):  # each of the other shards opened, read and closed (over the limit: idle)
            ds[i]
            assert list(reader_module._HANDLES) == [first._key]  # the least recently used, but in use
        first.close()  # asked to close while in use: it stays open
        st = os.fstat(fd)
        assert (st.st_dev, st.st_ino) == first._identity[:2]
    assert list(reader_module._HANDLES) == [first._key]
    assert same(ds[0], dict(zip(("input_ids", "hidden_states", "loss_mask"), make_sample(3, seed=0), strict=True)))


def test_a_forked_child_reopens_its_files(tmp_path):
    ds = open_dataset(write_shards(tmp_path, 3))
    ds[0]
    inherited = [h.fd for h in reader_module._HANDLES.values()]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's descriptors closed, its own opened as it reads
        try:
            closed = all(not _is_open(fd) for fd in inherited) and not reader_module._HANDLES
            ok = closed and same(ds[1], dict(zip(("input_ids", "hidden_states", "loss_mask"),
                                                 make_sample(4, seed=1), strict=True)))
            os.write(write, b"1" if ok and len(reader_module._HANDLES) == 1 else b"0")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    os.waitpid(pid, 0)
    assert all(_is_open(fd) for fd in inherited)  # the parent's stay open


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.mark.parametrize("how", ["renamed over", "rewritten in place"])
def test_a_shard_replaced_after_opening_is_refused(tmp_path, monkeypatch, how):
    """While the reader holds its file, it reads the file its index was read from; reopened (the cache closed it, a
    DataLoader worker, a pickled copy), the file at the path must be that file, or the read says so."""
    a, b = write_shards(tmp_path, 2)
    r = ShardReader(a)
    want = r[0]
    if how == "renamed over":
        os.replace(b, a)
    else:  # same inode, same size, a byte of sample 1's record flipped, a later mtime
        data, st = bytearray(a.read_bytes()), a.stat()
        data[r.index["offsets"][1] + 40] ^= 0xFF
        a.write_bytes(bytes(data))
        os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    if how == "renamed over":
        assert same(r[0], want)  # the descriptor held: the original file, still
    for reader in (pickle.loads(pickle.dumps(r)), r):  # a spawned worker's copy; r itself once its file is closed
        reader.close()
        with pytest.raises(ShardError) as e:
            reader[0]
        assert type(e.value) is ShardError and str(e.value).startswith(f"{a}: {REPLACED} (device, inode, size, ")
        assert str(e.value).endswith("Open the dataset (or shard) again to read the file as it is now")
    ds = open_dataset([a])
    ds[0]
    os.utime(a, ns=(0, 0))  # modified once more: the parent's held descriptor reads on; a forked worker reopens
    assert type(ds[0]) is dict
    with pytest.raises(ShardError, match=REPLACED):
        list(DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork", timeout=120))
    assert type(ShardReader(a)[0]) is dict  # opened again: read as it is now


def test_a_shard_deleted_after_opening_is_a_shard_error(tmp_path):
    """Reopened (a worker, a read after close) once the file is gone: a ShardError saying so (it was a bare
    FileNotFoundError); a reader opened then: no such shard file."""
    a, _ = write_shards(tmp_path, 2)
    r = ShardReader(a)
    r.close()
    a.unlink()
    with pytest.raises(ShardError) as e:
        r[0]
    assert str(e.value) == (f"{a}: deleted since it was opened (a DataLoader worker, or a read after the file was "
                            "closed, opens it again); rerun its chunk, and open the dataset again")
    with pytest.raises(ShardError, match=f"^{a}: no such shard file"):
        ShardReader(a)


def test_a_shard_replaced_while_the_cache_had_closed_it_is_refused_not_called_damaged(tmp_path, monkeypatch):
    """With another shard's bytes at its path, the old code read them and called the shard damaged (checksum
    mismatch: "delete it and rerun its chunk"); the file is not damaged, the dataset must be opened again."""
    monkeypatch.setattr(reader_module, "MAX_OPEN", 0)  # every file closed when idle
    a, b = write_shards(tmp_path, 2)
    ds = open_dataset([a, b])
    assert not reader_module._HANDLES
    os.replace(b, a)
    with pytest.raises(ShardError, match=REPLACED) as e:
        ds[0]
    assert not isinstance(e.value, CorruptShardError)
    assert not reader_module._HANDLES


def test_a_shard_rewritten_in_place_under_a_held_descriptor_is_refused_not_called_damaged(tmp_path):
    """`cp` (or `rsync --inplace`) of another shard over one a dataset reads with a descriptor held: its records are
    read from the new bytes and disagree with the index read before. Not damage (the message would have the user
    delete a whole file): the file changed since it was opened, so the dataset must be opened again."""
    a, b, c = write_shards(tmp_path, 3, per=3)
    ds = open_dataset([a, b])
    ds[0]
    a.write_bytes(c.read_bytes())  # the same inode, the third shard's bytes (other samples at other offsets)
    for i in (0, 1, 2):
        with pytest.raises(ShardError) as e:
            ds[i]
        assert type(e.value) is ShardError
        assert str(e.value).startswith(f"{a}: sample {i}: modified on disk since it was opened (device, inode, size, ")
        assert str(e.value).endswith("Open the dataset (or shard) again to read the file as it is now")
    assert len(open_dataset([a, b])) == 6 and type(open_dataset([a, b])[0]) is dict  # opened again: read as it is




def test_a_relative_path_reads_after_chdir_in_workers_and_reopens(tmp_path, monkeypatch):
    """A dataset opened by a relative path (as the README shows), then the working directory changed (Hydra's
    job folder): forked workers and a reopen after the cache closed a file read the same files, and no read
    calls them deleted."""
    write_shards(tmp_path / "shards", 3)
    monkeypatch.chdir(tmp_path)
    ds = open_dataset("shards")
    want = [ds[i] for i in range(len(ds))]
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setattr(reader_module, "MAX_OPEN", 1)  # every read of another shard closes and reopens one
    assert all(same(ds[i], want[i]) for i in (0, 2, 4, 1, 5))
    got = list(DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork", timeout=120))
    assert len(got) == len(want) and all(same(a, b) for a, b in zip(got, want, strict=True))
    assert str(ds.readers[0].path) == "shards/chunk-00000.hss"  # named as given


def test_a_damaged_shard_is_a_corrupt_shard_error_through_dataloader_workers_and_pickle(tmp_path):
    """torch re-raises a worker's error as its type built from the message alone: CorruptShardError must stay
    itself there (a trainer that skips damaged shards catches it), and survive pickling with its fields."""
    (path,) = write_shards(tmp_path / "shards", 1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    ds = open_dataset(path)
    with pytest.raises(CorruptShardError) as direct:
        list(DataLoader(ds, batch_size=None, num_workers=0))
    with pytest.raises(CorruptShardError) as worker:
        list(DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="fork", timeout=120))
    assert str(direct.value) in str(worker.value)  # torch adds the worker's traceback around the message
    e = pickle.loads(pickle.dumps(direct.value))
    assert (type(e), str(e), e.path, e.sample, e.what) == (
        CorruptShardError, str(direct.value), direct.value.path, direct.value.sample, direct.value.what)
    assert direct.value.path == str(path) and direct.value.sample is not None


@pytest.mark.parametrize("cut", [3, 10, 25])
def test_a_shard_cut_inside_its_header_or_metadata_is_called_truncated(tmp_path, cut):
    (path,) = write_shards(tmp_path / "shards", 1)
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(CorruptShardError) as e:
        ShardReader(path)
    where = "inside the 20-byte header" if cut < 20 else "inside the header's metadata (bytes 20.."
    assert str(e.value).startswith(f"{path}: shard structure: file truncated at byte {cut}: {where}"), str(e.value)
