"""Shard writer/reader: byte-exact round trips, random access, corruption, atomicity."""

import concurrent.futures
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc

import pytest
import torch
from conftest import make_sample, shard_metadata

from hsextract.errors import CorruptShardError, ShardError
from hsextract.shard import ShardReader, ShardWriter
from hsextract.shard import format as fmt
from hsextract.shard import reader as reader_module
from hsextract.shard.codec import dequantize_fp8, quantize_fp8


def bits(t):
    return t.contiguous().view(torch.uint8)


def assert_same(sample, ids, hs, mask):
    assert sample["input_ids"].dtype == torch.int64 and torch.equal(sample["input_ids"], ids)
    assert sample["loss_mask"].dtype == torch.int64 and torch.equal(sample["loss_mask"], mask)
    assert isinstance(sample["hidden_states"], list) and len(sample["hidden_states"]) == len(hs)
    for got, want in zip(sample["hidden_states"], hs, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(bits(got), bits(want))  # byte-exact, NaN payloads included


def write(path, samples, meta=None, **kw):
    with ShardWriter(path, meta or shard_metadata(), **kw) as w:
        for k, (ids, hs, mask) in enumerate(samples):
            w.add(ids, hs, mask, sample_id=f"s{k}")
    return path


@pytest.mark.parametrize("dtype,name",
                         [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float32")])
def test_round_trip_is_byte_exact_with_special_values(tmp_path, dtype, name):
    samples = [make_sample(s, dtype=dtype, seed=s) for s in (1, 7, 33)]
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40], dtype=torch.float32).to(dtype)
    samples[1][1][0][0, :6] = special
    # a NaN with a non-default payload must survive too
    raw = samples[1][1][1].view(torch.uint8)
    raw[0, : dtype.itemsize] = 0xFF
    path = write(tmp_path / "a.hss", samples, shard_metadata(dtype=name))
    r = ShardReader(path)
    assert len(r) == 3 and r.sample_ids == ["s0", "s1", "s2"] and r.seq_lens == [1, 7, 33]
    for k, s in enumerate(samples):
        assert_same(r[k], *s)
    assert r.metadata["dtype"] == name and r.metadata["format_version"] == fmt.FLAT_VERSION


@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_byte_planes_split_and_join_exactly_across_join_blocks(itemsize):
    import numpy as np

    from hsextract.shard.codec import JOIN_BLOCK, join_planes, split_planes

    n = 2 * JOIN_BLOCK + 5  # two whole blocks of join_planes and a short one
    raw = np.random.default_rng(itemsize).integers(0, 256, n * itemsize, dtype=np.uint8)
    planes = split_planes(raw, itemsize)
    assert [p.tobytes() for p in planes] == [raw[k::itemsize].tobytes() for k in range(itemsize)]
    assert join_planes([p.tobytes() for p in planes], itemsize, raw.size).tobytes() == raw.tobytes()


def test_zero_trained_tokens_and_one_token(tmp_path):
    samples = [make_sample(1), make_sample(5, trained=False)]
    r = ShardReader(write(tmp_path / "a.hss", samples))
    assert_same(r[0], *samples[0])
    assert_same(r[1], *samples[1])
    assert r.index["num_trained"] == [1, 0]


def test_ten_thousand_samples_random_access_equals_sequential(tmp_path):
    samples = [make_sample(1 + k % 5, hidden=4, seed=k) for k in range(10_000)]
    r = ShardReader(write(tmp_path / "big.hss", samples, shard_metadata(hidden_size=4)))
    assert len(r) == 10_000
    seq = list(r.iter_samples(threads=2))
    order = list(range(10_000))
    random.Random(0).shuffle(order)
    for i in order[:500]:
        assert_same(r[i], *samples[i])
        assert_same(seq[i], *samples[i])
    assert_same(r[-1], *samples[-1])
    with pytest.raises(IndexError, match="sample 10000 out of range"):
        r[10_000]


class _Inline:
    """A ThreadPoolExecutor that runs each task at submission, recording which sample it was asked for."""

    def __init__(self, *args, **kwargs):
        self.asked = asked = []
        _Inline.asked = asked

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, i):
        self.asked.append(i)
        done = concurrent.futures.Future()
        done.set_result(fn(i))
        return done


@pytest.mark.parametrize("ahead_bytes,lookahead,ahead", [(1 << 30, 4, 4), (0, 4, 1), (2 * 9 * 16_400, 4, 2),
                                                          (1 << 30, 2, 2), (1 << 30, 0, 1)])
def test_iteration_holds_a_bounded_number_of_samples_ahead(tmp_path, monkeypatch, ahead_bytes, lookahead, ahead):
    """iter_samples decodes up to `lookahead` samples ahead of the consumer, and beyond the next one no more than
    AHEAD_BYTES (a long sample of a large model is GBs): at sample k it has asked for samples up to k + ahead.
    A sample here is 9 tokens of 4 tensors of 2,048 bf16 values, with ids and mask (16,400 B a token)."""
    samples = [make_sample(9, hidden=2048, n=4, seed=k) for k in range(7)]
    r = ShardReader(write(tmp_path / "s.hss", samples, shard_metadata(hidden_size=2048)))
    monkeypatch.setattr(reader_module, "ThreadPoolExecutor", _Inline)
    monkeypatch.setattr(reader_module, "AHEAD_BYTES", ahead_bytes)
    for k, got in enumerate(r.iter_samples(threads=2, lookahead=lookahead)):
        assert_same(got, *samples[k])
        assert max(_Inline.asked) == min(k + ahead, 6), (k, _Inline.asked)
    assert _Inline.asked == list(range(7))


@pytest.mark.parametrize("ahead_bytes,most", [(8 << 30, 3), (0, 1), (2 * (9 * 4 * 2048 * 2 + 9 * 16), 2)])
def test_the_writer_holds_a_bounded_number_of_samples_encoding(tmp_path, monkeypatch, ahead_bytes, most):
    """With encoder threads, samples encode ahead of the file: threads + 1 of them, and beyond the newest no more than
    ENCODE_AHEAD_BYTES of their tensors (Kimi-K2.5's long samples are GBs each); the shard the same either way."""
    from hsextract.shard import writer as writer_module

    monkeypatch.setattr(writer_module, "ENCODE_AHEAD_BYTES", ahead_bytes)
    samples = [make_sample(9, hidden=2048, n=4, seed=k) for k in range(6)]  # and ids, mask: 147,600 B each
    held = []
    with ShardWriter(tmp_path / "s.hss", shard_metadata(hidden_size=2048), threads=2) as w:
        for k, (ids, hs, mask) in enumerate(samples):
            w.add(ids, hs, mask, sample_id=f"s{k}")
            held.append(len(w._pending))
    assert held == [min(k + 1, most) for k in range(6)]
    r = ShardReader(tmp_path / "s.hss")
    for k in range(6):
        assert_same(r[k], *samples[k])


@pytest.mark.parametrize("precision", ["bf16", "fp8_e4m3"])
def test_threads_give_identical_bytes(tmp_path, precision):
    # 12 samples of varied lengths: more than the 4 the 3-thread writer encodes ahead (pipelined), so
    # records finishing out of order must still land in call order
    samples = [make_sample(1 + 17 * (k % 5), seed=k) for k in range(12)]
    a = write(tmp_path / "a.hss", samples, threads=1, precision=precision).read_bytes()
    b = write(tmp_path / "b.hss", samples, threads=3, precision=precision).read_bytes()
    assert a == b
    r = ShardReader(tmp_path / "b.hss")
    assert r.sample_ids == [f"s{k}" for k in range(12)]
    for k, (ids, hs, mask) in enumerate(samples):
        if precision == "bf16":
            assert_same(r[k], ids, hs, mask)
        else:  # quantized by the encoding threads: exactly what quantize + dequantize give
            got = r[k]["hidden_states"]
            assert all(torch.equal(bits(g), bits(dequantize_fp8(*quantize_fp8(h), torch.bfloat16)))
                       for g, h in zip(got, hs, strict=True))


def test_failing_background_encode_leaves_no_shard(tmp_path, monkeypatch):
    """An error inside a worker thread surfaces from add()/close() and no shard or temp file remains."""
    w = ShardWriter(tmp_path / "a.hss", shard_metadata(), threads=2)
    real = w._encode_unit
    calls = []

    def flaky(unit, t):  # the 8th tensor encoded: one of sample 1's, on a pool thread
        calls.append(1)
        if len(calls) == 8:
            raise MemoryError("simulated")
        return real(unit, t)

    monkeypatch.setattr(w, "_encode_unit", flaky)
    with pytest.raises(MemoryError, match="simulated"):
        with w:
            for k in range(6):
                w.add(*make_sample(5, seed=k))
    assert list(tmp_path.iterdir()) == []


def test_background_sync_runs_while_writing_and_changes_no_byte(tmp_path, monkeypatch):
    samples = [make_sample(1 + 17 * (k % 5), seed=k) for k in range(12)]
    ref = write(tmp_path / "a.hss", samples, sync_every_mb=0).read_bytes()
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(os.fstat(fd).st_size), real(fd)))
    w = ShardWriter(tmp_path / "b.hss", shard_metadata(), threads=2)
    w._sync_every = 4096  # bytes here; MB in the API
    start_sync = w._background_sync

    def start_and_wait() -> None:
        # A sync still running when the next is due is skipped, so how many run would depend on thread
        # timing: the writer thread waits for each one here (an event, not a delay), so every due sync runs.
        start_sync()
        if w._sync is not None:
            w._sync.result()

    w._background_sync = start_and_wait
    with w:
        for k, (ids, hs, mask) in enumerate(samples):
            w.add(ids, hs, mask, sample_id=f"s{k}")
    assert (tmp_path / "b.hss").read_bytes() == ref
    # a sync is due once 4096 bytes were written since the last: after the header (its own chunk) or a record
    ix = ShardReader(tmp_path / "b.hss").index
    due, last = [], 0
    for end in [ix["offsets"][0]] + [o + n for o, n in zip(ix["offsets"], ix["record_lens"], strict=True)]:
        if end - last >= 4096:
            due.append(end)
            last = end
    assert len(due) >= 2 and due[-1] < len(ref) and synced == due  # during the writing, never at close


def slow_disk(w: ShardWriter, delay_s: float = 0.05) -> ShardWriter:
    """Every write of `w`'s file takes `delay_s` (a disk in a journal commit); only its writer thread writes."""
    real = w._file.write

    def slow(b):
        time.sleep(delay_s)
        return real(b)

    w._file.write = slow
    return w


def test_summary_says_whether_encoding_or_the_disk_held_the_writer_up(tmp_path, monkeypatch):
    # Lower bounds only: each sleep is a minimum, and a loaded machine only adds to the waits.
    samples = [make_sample(5, seed=k) for k in range(8)]
    real_encode = ShardWriter._encode_unit
    monkeypatch.setattr(ShardWriter, "_encode_unit",
                        lambda self, u, t: (time.sleep(0.1 / 6), real_encode(self, u, t))[1])  # 6 tensors a sample
    with ShardWriter(tmp_path / "slow-encoder.hss", shard_metadata(), threads=2) as w:
        for sample in samples:
            w.add(*sample)
        enc = w.close()
    monkeypatch.setattr(ShardWriter, "_encode_unit", real_encode)

    with slow_disk(ShardWriter(tmp_path / "slow-disk.hss", shard_metadata(), threads=2)) as w:
        for sample in samples[:4]:
            w.add(*sample)
        disk = w.close()
    # 8 encodes of >= 0.1 s on 2 threads: >= 0.4 s, nearly all of it waited for by add() and close()
    assert enc.encode_wait_s >= 0.25
    # 4 records of two writes each (header, payload) at >= 0.05 s, all waited for by close()
    assert disk.write_s >= 0.05 * 4 * 2 and disk.disk_s >= 0.05 * 4 * 2


def recording_disk(w: ShardWriter, gate: threading.Event | None = None) -> list[int]:
    """Count the bytes `w`'s writer thread has written (a list holding the running total); with `gate`,
    every write waits until it is set (a stalled disk)."""
    written = [0]
    real = w._file.write

    def write(b):
        if gate is not None:
            assert gate.wait(120), "the test never released the stalled disk"
        n = real(b)
        written[0] += len(b)
        return n

    w._file.write = write
    return written


def test_a_stalling_disk_does_not_stop_add_within_the_write_ahead(tmp_path):
    """Decided on bytes, not on time: with room ahead, every add() returns while the disk is stalled; with no
    room, add(k) returns only once every earlier record is on the file."""
    samples = [make_sample(9, seed=k) for k in range(6)]
    ref = write(tmp_path / "ref.hss", samples).read_bytes()

    stalled = threading.Event()
    w = ShardWriter(tmp_path / "ahead.hss", shard_metadata(), threads=2)
    written = recording_disk(w, stalled)
    with w:
        for k, (ids, hs, mask) in enumerate(samples):
            w.add(ids, hs, mask, sample_id=f"s{k}")
            assert written[0] == 0  # returned although nothing reached the disk
        stalled.set()
        w.close()
    assert (tmp_path / "ahead.hss").read_bytes() == ref

    # a slow disk, so that an add() that did not wait would be caught ahead of the writer
    w = slow_disk(ShardWriter(tmp_path / "none.hss", shard_metadata(), threads=1), 0.02)
    w._ahead = 1  # bytes here; MB in the API
    written = recording_disk(w)
    with w:
        for k, (ids, hs, mask) in enumerate(samples):
            before = w._pos  # the file's size once every earlier record is written
            w.add(ids, hs, mask, sample_id=f"s{k}")
            assert written[0] >= before
        w.close()
    assert (tmp_path / "none.hss").read_bytes() == ref


def test_failing_background_sync_leaves_no_shard(tmp_path, monkeypatch):
    def eio(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    w = ShardWriter(tmp_path / "a.hss", shard_metadata(), threads=1)
    w._sync_every = 1024
    # raised by the next write after the sync failed, or by close() if the sync thread had not finished by then
    with pytest.raises(ShardError, match=r"a\.hss: (writing failed after \d+ samples \(Input/output error\)|"
                                         r"finishing the shard failed \(Input/output error\)); no shard "):
        with w:
            for k in range(20):
                w.add(*make_sample(20, seed=k))
    assert list(tmp_path.iterdir()) == []


def test_a_shard_that_fails_at_its_commit_says_what_to_do(tmp_path, monkeypatch):
    """The close's fsync on a full disk (ENOSPC there, not in a write): the same advice as a failed write."""
    def enospc(fd):
        raise OSError(28, "No space left on device")

    w = ShardWriter(tmp_path / "a.hss", shard_metadata(), threads=1)
    w.add(*make_sample(20))
    monkeypatch.setattr(os, "fsync", enospc)
    with pytest.raises(ShardError) as e:
        w.close()
    assert str(e.value) == (f"{tmp_path / 'a.hss'}: finishing the shard failed (No space left on device); no shard "
                            f"was left behind. Free space in {tmp_path} (or fix the error) and rerun the chunk.")
    assert list(tmp_path.iterdir()) == []


def test_metadata_is_self_describing(tmp_path):
    r = ShardReader(write(tmp_path / "a.hss", [make_sample(3)], level=5))
    m = r.metadata
    for key in ("model", "engine", "engine_version", "aux_layers", "final_state", "hidden_size", "dtype",
                "config_hash", "tokenizer_hash", "chat_template_hash", "format_version", "precision", "codec"):
        assert key in m
    assert m["codec"] == {"name": "zstd-byteplane", "level": 5}
    assert m["num_hidden_tensors"] == 4 and m["stored_dtype"] == "bfloat16"


def test_no_pickle_in_shard(tmp_path):
    data = write(tmp_path / "a.hss", [make_sample(3)]).read_bytes()
    assert b"\x80\x02" not in data[:64] and pickle.PROTO not in data[:2]
    assert data[:8] == b"HSXSHARD" and data[-8:] == b"HSXSEND\0"


@pytest.mark.parametrize("decode_threads", [1, 3])
def test_every_flipped_byte_is_an_error(tmp_path, monkeypatch, decode_threads):
    # decode_threads 3: records read in parallel slices (every record, here) and the payload checked while
    # the hidden tensors decode
    monkeypatch.setattr(reader_module, "PARALLEL_READ_MIN", 0)
    samples = [make_sample(6, seed=k) for k in range(3)]
    path = write(tmp_path / "a.hss", samples)
    good = path.read_bytes()
    rng = random.Random(1)
    positions = sorted(set(rng.randrange(len(good)) for _ in range(300)) | {0, 9, 20, len(good) - 1, len(good) - 20})
    bad = tmp_path / "bad.hss"
    r0 = ShardReader(path)
    first_record = r0.index["offsets"][0]
    for pos in positions:
        data = bytearray(good)
        data[pos] ^= 1 << rng.randrange(8)
        bad.write_bytes(bytes(data))
        with pytest.raises(ShardError) as e:
            r = ShardReader(bad, decode_threads=decode_threads)
            for i in range(len(r)):
                r[i]
        msg = str(e.value)
        assert str(bad) in msg
        if isinstance(e.value, CorruptShardError) and e.value.sample is not None:
            assert f"sample {e.value.sample}" in msg
            # the named sample is the one whose bytes were hit
            offs = r0.index["offsets"]
            # (an index or footer hit names none: every record is intact; a missing footer: tested below)
            assert first_record <= pos < r0._index_offset
            assert e.value.sample == max(k for k in range(len(offs)) if offs[k] <= pos)


def test_truncation_names_the_sample(tmp_path):
    samples = [make_sample(6, seed=k) for k in range(4)]
    path = write(tmp_path / "a.hss", samples)
    good = path.read_bytes()
    offs = ShardReader(path).index["offsets"]
    cut = tmp_path / "cut.hss"
    for end in (offs[2] + 30, offs[1] + 3, len(good) - 3, offs[0]):
        cut.write_bytes(good[:end])
        with pytest.raises(CorruptShardError) as e:
            ShardReader(cut)
        assert "truncated" in str(e.value) and str(cut) in str(e.value)
        # cut between records or after the last one (in the footer): no sample named, the whole records said
        expect = {offs[2] + 30: 2, offs[1] + 3: 1}.get(end)
        assert e.value.sample == expect, (end, str(e.value))
    assert str(e.value) == (f"{cut}: shard structure: file truncated at byte {offs[0]} or its end damaged: no valid "
                            f"footer; no record is complete, what followed byte {offs[0]} (any further samples, the "
                            "index, the footer) is missing. The shard is damaged: delete it and rerun its chunk "
                            "(snakemake reruns a missing shard).")
    # cut a few bytes into the index, fewer than a record header holds: still no sample named
    cut.write_bytes(good[:ShardReader(path)._index_offset + 5])
    with pytest.raises(CorruptShardError, match=r"records 0\.\.3 are complete, what followed byte \d+ \(any"):
        ShardReader(cut)
    cut.write_bytes(good[:-3])
    with pytest.raises(CorruptShardError, match=r"records 0\.\.3 are complete, what followed byte \d+ \(any"):
        ShardReader(cut)


def test_exception_inside_writer_leaves_nothing(tmp_path):
    path = tmp_path / "a.hss"
    with pytest.raises(RuntimeError):
        with ShardWriter(path, shard_metadata()) as w:
            w.add(*make_sample(4))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_writer_left_open_leaves_no_temp_file(tmp_path):
    """A writer neither closed nor in a `with` block: dropped (its writer thread holds it, so no __del__ runs) or
    held by a module when an uncaught error ends the process, its temp file goes at exit; no shard is written."""
    path = tmp_path / "a.hss"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from conftest import make_sample, shard_metadata
        from hsextract.shard import ShardWriter
        dropped = ShardWriter({str(tmp_path / "b.hss")!r}, shard_metadata())
        dropped.add(*make_sample(4))
        del dropped
        w = ShardWriter({str(path)!r}, shard_metadata())
        w.add(*make_sample(4))
        w.add(*make_sample(4)[:2], None)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "loss_mask must be an integer tensor" in p.stderr, p.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_killed_writer_leaves_no_shard_and_next_writer_cleans_up(tmp_path):
    path = tmp_path / "a.hss"
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from conftest import make_sample, shard_metadata
        from hsextract.shard import ShardWriter
        w = ShardWriter({str(path)!r}, shard_metadata())
        w.add(*make_sample(4))
        print("ready", flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not path.exists()
    leftovers = list(tmp_path.glob(".a.hss.*.tmp"))
    assert len(leftovers) == 1
    write(path, [make_sample(3)])
    assert sorted(os.listdir(tmp_path)) == ["a.hss"]


def test_bad_input_is_refused_with_the_sample_named(tmp_path):
    path = tmp_path / "a.hss"
    with ShardWriter(path, shard_metadata()) as w:
        ids, hs, mask = make_sample(4)
        w.add(ids, hs, mask)
        with pytest.raises(ShardError,
                           match=r"sample 1: hidden_states\[2\] is float32 \(4, 16\), expected bfloat16 \(4, 16\)"):
            w.add(ids, hs[:2] + [hs[2].float()] + hs[3:], mask)
        with pytest.raises(ShardError, match=r"sample 1: 3 hidden-state tensors, expected 4"):
            w.add(ids, hs[:3], mask)
        with pytest.raises(ShardError, match=r"sample 1: loss_mask must be an integer tensor of shape \(4,\)"):
            w.add(ids, hs, mask[:3])
        with pytest.raises(ShardError) as e:  # not tensors at all: said as such, not an AttributeError
            w.add(ids, hs, None)
        assert str(e.value) == f"{path}: sample 1: loss_mask must be an integer tensor of shape (4,), got a NoneType"
        with pytest.raises(ShardError) as e:
            w.add(ids.tolist(), hs, mask)
        assert str(e.value) == f"{path}: sample 1: input_ids must be a non-empty 1-D integer tensor, got a list"
        with pytest.raises(ShardError) as e:
            w.add(ids, [h.float().numpy() if k == 1 else h for k, h in enumerate(hs)], mask)
        assert str(e.value) == (f"{path}: sample 1: hidden_states must be a list of 4 tensors, got a list of "
                                "['Tensor', 'ndarray']")
    assert len(ShardReader(path)) == 1
    with pytest.raises(ShardError, match=r"metadata lacks \['tokenizer_hash'\]"):
        meta = shard_metadata()
        del meta["tokenizer_hash"]
        ShardWriter(tmp_path / "b.hss", meta)


@pytest.mark.parametrize("decode_threads", [1, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp8_e4m3"])
def test_a_sample_decoded_into_shared_memory_is_the_same_sample(tmp_path, precision, decode_threads):
    samples = [make_sample(5 + 9 * k, seed=k) for k in range(3)]
    r = ShardReader(write(tmp_path / "a.hss", samples, precision=precision), decode_threads=decode_threads)
    for k in range(3):
        plain, shared = r[k], r.sample(k, shared_memory=True)
        tensors = [shared["input_ids"], shared["loss_mask"], *shared["hidden_states"]]
        assert all(t.is_shared() for t in tensors)
        assert not any(t.is_shared() for t in [plain["input_ids"], *plain["hidden_states"]])
        for a, b in zip(tensors, [plain["input_ids"], plain["loss_mask"], *plain["hidden_states"]], strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def test_fp8_mode_dequantizes_to_bf16(tmp_path):
    samples = [make_sample(32, hidden=64, seed=3)]
    samples[0][1][0][5].zero_()
    path = write(tmp_path / "a.hss", samples, shard_metadata(hidden_size=64), precision="fp8_e4m3")
    r = ShardReader(path)
    assert r.metadata["precision"] == "fp8_e4m3" and r.metadata["stored_dtype"] == "float8_e4m3fn"
    got = r[0]
    for a, b in zip(got["hidden_states"], samples[0][1], strict=True):
        assert a.dtype == torch.bfloat16
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 0.05  # e4m3 has 3 mantissa bits: ~2-3% relative error per element
    assert torch.equal(got["hidden_states"][0][5], torch.zeros(64, dtype=torch.bfloat16))
    assert torch.equal(got["input_ids"], samples[0][0])


@pytest.mark.parametrize("decode_threads", [1, 2])
def test_reader_survives_fork_and_pickle(tmp_path, decode_threads):
    samples = [make_sample(5, seed=k) for k in range(8)]
    r = ShardReader(write(tmp_path / "a.hss", samples), decode_threads=decode_threads)
    r[0]  # opens the file and (decode_threads 2) starts the decode threads in this process
    clone = pickle.loads(pickle.dumps(r))
    assert_same(clone[3], *samples[3])
    from torch.utils.data import DataLoader

    from hsextract import open_dataset

    ds = open_dataset([tmp_path / "a.hss"], decode_threads=decode_threads)
    ds[0]  # the workers are forked from a process whose decode pool has threads; theirs must start anew
    # timeout: a worker stuck on a pool without threads fails the test instead of hanging it
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=120)
    got = list(loader)
    assert len(got) == 8
    for k, s in enumerate(got):
        assert_same(s, *samples[k])


def test_frames_with_content_checksums_still_read(tmp_path, monkeypatch):
    """Shards of older writers carry zstd content checksums in every frame; they must read."""
    import zstandard as zstd

    from hsextract.shard.codec import Codec

    def with_checksum(make):
        def f(self):
            c = make(self)
            return zstd.ZstdCompressor(compression_params=zstd.ZstdCompressionParameters.from_level(
                self.level, write_checksum=True)) if c is not None else c
        return f

    for name in ("plane_compressor", "low_plane_compressor", "whole_compressor"):
        monkeypatch.setattr(Codec, name, with_checksum(getattr(Codec, name)))
    samples = [make_sample(9, seed=k) for k in range(3)]
    path = write(tmp_path / "old.hss", samples)
    monkeypatch.undo()
    data = path.read_bytes()
    r = ShardReader(path)
    table = r.index["offsets"][0] + fmt.RECORD.size  # sample 0's frame table: u32 count, u64 lengths
    n_frames = int.from_bytes(data[table:table + 4], "little")
    assert zstd.get_frame_parameters(data[table + 4 + 8 * n_frames:]).has_checksum
    new = write(tmp_path / "new.hss", samples).read_bytes()  # today's writer: no content checksum
    assert not zstd.get_frame_parameters(new[table + 4 + 8 * n_frames:]).has_checksum
    for k, (ids, hs, mask) in enumerate(samples):
        assert_same(r[k], ids, hs, mask)


@pytest.mark.parametrize("precision", ["bf16", "fp8_e4m3"])
def test_samples_read_earlier_are_not_changed_by_later_reads(tmp_path, precision):
    """The reader reuses one record buffer per thread: no returned tensor may point into it."""
    samples = [make_sample(n, seed=k) for k, n in enumerate((7, 30, 5, 30))]
    r = ShardReader(write(tmp_path / "a.hss", samples, precision=precision))
    first = r[1]
    kept = {"input_ids": first["input_ids"].clone(), "loss_mask": first["loss_mask"].clone(),
            "hidden_states": [h.clone() for h in first["hidden_states"]]}
    for i in (3, 0, 2, 3):  # records of the same and other sizes through the same buffer
        r[i]
    assert torch.equal(first["input_ids"], kept["input_ids"]) and torch.equal(first["loss_mask"], kept["loss_mask"])
    assert all(torch.equal(a, b) for a, b in zip(first["hidden_states"], kept["hidden_states"], strict=True))


@pytest.mark.parametrize("precision", ["bf16", "fp8_e4m3"])
def test_decode_threads_give_the_same_samples(tmp_path, monkeypatch, precision):
    monkeypatch.setattr(reader_module, "PARALLEL_READ_MIN", 0)  # every record read in parallel slices
    samples = [make_sample(n, seed=k) for k, n in enumerate((7, 30, 1, 12))]
    path = write(tmp_path / "a.hss", samples, precision=precision)
    one, three = ShardReader(path), ShardReader(path, decode_threads=3)
    for k in (2, 0, 3, 1):
        a, b = one[k], three[k]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a["hidden_states"], b["hidden_states"], strict=True))
        if precision == "bf16":
            assert_same(b, *samples[k])


def test_decode_threads_report_a_frame_that_fails_in_a_decode_thread(tmp_path, monkeypatch):
    import zstandard as zstd

    samples = [make_sample(6, seed=k) for k in range(3)]
    path = write(tmp_path / "a.hss", samples)
    real = zstd.ZstdDecompressor

    class FailsOffMainThread:  # hidden tensors decode on the pool's threads, ids and mask on the caller's
        def __init__(self):
            self.d = real()

        def decompress(self, data, **kw):
            if threading.current_thread() is not threading.main_thread():
                raise zstd.ZstdError("simulated")
            return self.d.decompress(data, **kw)

    monkeypatch.setattr(zstd, "ZstdDecompressor", FailsOffMainThread)
    monkeypatch.setattr(reader_module, "_POOLS", {})  # threads of their own: none holds an earlier test's context
    r = ShardReader(path, decode_threads=2)
    try:
        with pytest.raises(CorruptShardError, match=r"sample 1: frame does not decode \(simulated\)") as e:
            r[1]
    finally:
        for pool in reader_module._POOLS.values():
            pool.shutdown()
    assert str(path) in str(e.value) and e.value.sample == 1


def test_decode_threads_must_be_a_positive_integer(tmp_path):
    path = write(tmp_path / "a.hss", [make_sample(3)])
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ShardError, match=f"decode_threads {bad!r}: must be an integer >= 1"):
            ShardReader(path, decode_threads=bad)


def test_fp8_dequantize_table_equals_torch_conversion_for_every_bit_pattern():
    """The lookup table stands in for torch's float8 -> float32 conversion: all 256 patterns (NaN, subnormals,
    -0, the extremes), times per-row scales, rounded to each output dtype."""
    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).repeat(4, 1)
    scale = torch.tensor([1.0, 3.0e-5, 7.25, 1.0e4], dtype=torch.float32)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        want = (q.float() * scale[:, None]).to(dtype)
        got = dequantize_fp8(q, scale, dtype)
        assert got.dtype == dtype and torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_a_nan_or_inf_stays_where_it_was_and_its_row_keeps_its_scale(dtype):
    """One inf made its row's scale inf, every value of the row NaN (validation: 256 non-finite, first at column 0);
    one NaN put its row on scale 1, clamping 1000 to 448; a float32 row below 448 x 2^-149 got scale 0 and its
    zeros NaN (fp8 audit). Now: the one value non-finite, the rest within fp8's half step of the row's finite max."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 256, generator=g) * 100).to(dtype)
    x[1, 3], x[2, 5], x[3, 7] = float("nan"), float("inf"), float("-inf")
    x[1, 9] = 1000.0
    if dtype == torch.float32:
        x[4] = torch.tensor([1.4e-43, -7e-44, 0.0, 1.4e-45] * 64)
    q, scale = quantize_fp8(x)
    y = dequantize_fp8(q, scale, dtype)
    bad = (~torch.isfinite(y)).nonzero().tolist()
    assert bad == [[1, 3], [2, 5], [3, 7]]
    ok = torch.isfinite(x)
    finite_max = x.float().abs().where(ok, 0).amax(dim=-1, keepdim=True)
    err = ((y.float() - x.float()).abs() / finite_max).where(ok, 0)
    assert err[:4].max() <= 1 / 28 + 2e-3  # fp8's half step (1/28 of the max) and the output's rounding
    assert y[1, 9].item() == pytest.approx(1000.0, rel=1 / 14)
    if dtype == torch.float32:
        assert y[4].abs().max().item() <= 1.5e-43  # within the row's own values: no NaN, no blow-up


def test_fp8_quantize_leaves_a_float32_input_unchanged():
    x = torch.randn(5, 16) * 100
    kept = x.clone()
    q, scale = quantize_fp8(x)
    assert torch.equal(x, kept) and q.dtype == torch.float8_e4m3fn and scale.shape == (5,)


def _resident(path):
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True,
                         text=True, check=True)
    return int(out.stdout.split()[0])


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or shutil.which("fincore") is None,
                    reason="needs posix_fadvise and util-linux fincore")
def test_prefetch_brings_a_whole_large_record_into_the_page_cache(tmp_path):
    """The kernel starts at most one readahead window of a WILLNEED range (8 MB here, 128 KB by default) and drops
    the rest: the record is asked for piece by piece, so all of it arrives."""
    path = tmp_path / "big.hss"
    with ShardWriter(path, shard_metadata(hidden_size=4096)) as w:
        w.add(*make_sample(1024, hidden=4096, seed=1), sample_id="big")  # 32 MB of bf16, 22 MB stored
        w.add(*make_sample(3, hidden=4096, seed=2), sample_id="small")
    r = ShardReader(path)
    rlen = r.index["record_lens"][0]
    assert rlen > 16 << 20
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if (before := _resident(path)) > rlen // 10:
        pytest.skip(f"{tmp_path}: its page cache cannot be dropped (tmpfs?)")
    deadline = time.monotonic() + 120  # the kernel reads on its own; this only bounds a failure
    while _resident(path) < rlen and time.monotonic() < deadline:
        # asked again while waiting: the kernel may drop a hint under load (one local run of 25 did), and a hint of the
        # whole range at once brings the same first window every time
        r.prefetch(0)
        time.sleep(0.05)
    assert _resident(path) >= rlen, f"resident {before} before, {_resident(path)} after; record {rlen} bytes"
    assert torch.equal(r[0]["hidden_states"][3], make_sample(1024, hidden=4096, seed=1)[1][3])


def test_prefetch_asks_for_exactly_the_record_in_pieces(tmp_path, monkeypatch):
    path = tmp_path / "s.hss"
    with ShardWriter(path, shard_metadata(hidden_size=512)) as w:
        for k in range(3):
            w.add(*make_sample(100 + 150 * k, hidden=512, seed=k), sample_id=f"s{k}")
    r = ShardReader(path)
    piece = 128 << 10  # this disk's may be larger than these records
    monkeypatch.setattr(reader_module, "hint_piece", lambda dev: piece)
    asked = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: asked.append((off, n, advice)))
    r.prefetch(2)
    off, rlen = r.index["offsets"][2], r.index["record_lens"][2]
    assert rlen > 2 * piece
    assert all(a == os.POSIX_FADV_WILLNEED and 0 < n <= piece for _, n, a in asked)
    assert [(o, o + n) for o, n, _ in asked] == [(o, min(o + piece, off + rlen)) for o in range(off, off + rlen, piece)]
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: (_ for _ in ()).throw(OSError(22, "Invalid argument")))
    r.prefetch(0)  # a file system that refuses the hint reads as before
    assert torch.equal(r[0]["input_ids"], make_sample(100, hidden=512, seed=0)[0])


def test_the_hint_piece_is_what_the_kernel_takes_of_one_willneed(tmp_path):
    """max(read_ahead_kb, max_sectors_kb) of the file's disk, found for a disk or a partition; 128 KiB (the default
    read_ahead_kb) where sysfs has no such device."""
    block = tmp_path / "dev" / "block"
    (block / "8:0" / "queue").mkdir(parents=True)
    (block / "8:0" / "queue" / "read_ahead_kb").write_text("8192\n")
    (block / "8:0" / "queue" / "max_sectors_kb").write_text("1280\n")
    (block / "8:0" / "8:1").mkdir()  # a partition: its queue is its disk's (sysfs: .../sda/sda1/../queue)
    (block / "8:1").symlink_to(block / "8:0" / "8:1")
    (block / "9:0" / "queue").mkdir(parents=True)
    (block / "9:0" / "queue" / "read_ahead_kb").write_text("0\n")
    (block / "9:0" / "queue" / "max_sectors_kb").write_text("64\n")
    assert reader_module.hint_piece(os.makedev(8, 0), tmp_path) == 8192 << 10
    assert reader_module.hint_piece(os.makedev(8, 1), tmp_path) == 8192 << 10
    assert reader_module.hint_piece(os.makedev(9, 0), tmp_path) == 64 << 10  # no readahead: max_sectors_kb
    assert reader_module.hint_piece(os.makedev(0, 52), tmp_path) == 128 << 10  # overlayfs, tmpfs: no block device


def test_threads_that_open_a_reader_at_once_share_one_descriptor(tmp_path, monkeypatch):
    """A stream worker's first sample: its hint, read and decode threads all reach a fresh reader's file at once;
    it is opened once (no descriptor left behind)."""
    path = tmp_path / "s.hss"
    with ShardWriter(path, shard_metadata()) as w:
        w.add(*make_sample(5), sample_id="s0")
    r = pickle.loads(pickle.dumps(ShardReader(path)))  # as a spawned worker receives it: not yet open
    opened, both_in = [], threading.Barrier(2)
    real_open = os.open

    def slow_open(*args, **kw):
        opened.append(args[0])
        try:
            both_in.wait(timeout=1)  # an unguarded second thread would arrive here too
        except threading.BrokenBarrierError:
            pass
        return real_open(*args, **kw)

    monkeypatch.setattr(reader_module.os, "open", slow_open)
    fds = []

    def use():
        with r._file() as fd:
            fds.append(fd)

    threads = [threading.Thread(target=use) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert opened == [path] and len(set(fds)) == 1 and fds[0] == reader_module._HANDLES[r._key].fd


def test_a_thread_keeps_one_record_buffer_whatever_shards_it_reads(tmp_path):
    """Record buffers are kept per thread, not per reader: a trainer's worker that reads from hundreds of shards
    must not hold a buffer for each of them."""
    readers = [ShardReader(write(tmp_path / f"{k}.hss", [make_sample(2000, seed=k)])) for k in range(12)]
    biggest = max(r.index["record_lens"][0] for r in readers)
    readers[0][0]  # this thread's buffer and zstd context exist before counting
    tracemalloc.start()
    try:
        for r in readers:
            r[0]
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert biggest > 100_000
    assert held < 2 * biggest
