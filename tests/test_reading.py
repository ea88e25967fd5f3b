"""The shards' sha256 computed early, in a thread, while the directory is prepared
(``reading.EarlyDigests``): the stream then reads each file without hashing it, only if it is the
same file, unchanged, when the stream opens it and when the stream is done with it. The shards are
read through the reader the safetensors backend declares (``frontend/checkpoint.py``)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from qcompiler.examples import tiny_llama_hf
from qcompiler.frontend.reading import Buffer, EarlyDigests, SourceTensor, source_tensors, stream_tensors
from qcompiler.frontend.weights_gate import SourceError


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    path = tmp_path / "src"
    tiny_llama_hf().save_pretrained(path)  # pyright: ignore[reportCallIssue]
    return path


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def finished(early: EarlyDigests) -> EarlyDigests:
    early.thread.join(timeout=60)
    assert not early.thread.is_alive()
    return early


def read_all(root: Path, early: EarlyDigests | None, job: Any = None) -> dict[str, str]:
    def keep(t: SourceTensor, data: Buffer) -> dict[str, Any]:
        return job(t, data) if job is not None else {}

    return stream_tensors(root, source_tensors(root), keep, 2, lambda n: None, None, early)[1]


def test_early_digests_are_the_files_sha256_and_the_stream_takes_them(llama_dir: Path) -> None:
    early = finished(EarlyDigests(llama_dir))
    shards = sorted(p.name for p in llama_dir.glob("*.safetensors"))
    assert sorted(early.done) == shards
    assert read_all(llama_dir, early) == {name: sha256_of(llama_dir / name) for name in shards}
    assert read_all(llama_dir, None) == read_all(llama_dir, finished(EarlyDigests(llama_dir)))


def test_a_file_changed_after_its_early_digest_is_hashed_by_the_stream(llama_dir: Path) -> None:
    early = finished(EarlyDigests(llama_dir))
    shard = next(llama_dir.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last tensor: the headers stay valid
    time.sleep(0.01)
    shard.write_bytes(bytes(data))
    assert read_all(llama_dir, early)[shard.name] == sha256_of(shard)
    assert early.stopped.is_set()


def test_a_file_changed_while_the_stream_reads_it_is_refused(llama_dir: Path) -> None:
    early = finished(EarlyDigests(llama_dir))
    shard = next(llama_dir.glob("*.safetensors"))

    def touch_once(t: SourceTensor, data: Buffer) -> dict[str, Any]:
        if not getattr(touch_once, "done", False):
            touch_once.done = True  # pyright: ignore[reportFunctionMemberAccess]
            before = shard.stat()
            with shard.open("r+b") as f:  # same bytes, but written: its change time moves
                f.seek(0)
                f.write(f.read(8))
            # file times come from a coarse clock (a few ms a tick): a write in the tick the early
            # hash began leaves them as they were, so the write also moves the modification time
            os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
        return {}

    with pytest.raises(SourceError, match="changed while the compile read it"):
        read_all(llama_dir, early, touch_once)


def test_what_the_source_policy_refuses_is_not_read_early(llama_dir: Path, tmp_path: Path) -> None:
    shard = next(llama_dir.glob("*.safetensors"))
    outside = tmp_path / "outside.safetensors"
    os.replace(shard, outside)
    shard.symlink_to(outside)  # a link out of the directory: the gates refuse it, the early hash too
    early = finished(EarlyDigests(llama_dir))
    assert shard.name not in early.done


def test_the_frontend_reads_shards_through_the_reader_the_safetensors_backend_declares(llama_dir: Path) -> None:
    from qcompiler import plugins
    from qcompiler.frontend.checkpoint import checkpoint_reader

    assert plugins.declared("CHECKPOINTS")["safetensors"] == "qcompiler.backends.safetensors.source"
    reader = checkpoint_reader()
    names = reader.shard_names(llama_dir)
    inventory = reader.checkpoint_inventory(llama_dir)
    tensors = source_tensors(llama_dir)
    assert list(tensors) == names
    assert {t.name: (t.file, t.dtype, t.shape) for ts in tensors.values() for t in ts} == {
        n: (d.file, d.dtype, d.shape) for n, d in inventory.items()
    }
    t = tensors[names[0]][0]
    with (llama_dir / t.file).open("rb") as fh:
        fh.seek(t.offset)
        assert fh.read(t.nbytes) == reader.read_declared(llama_dir, inventory[t.name], t.name)


def test_the_stream_reports_each_file_unchanged_while_it_was_read(llama_dir: Path) -> None:
    """``unchanged``: a shard's identity when the stream was done with it, only if it is the one it
    began with (its dense tensors' hashes then vouch for reads of that file: ``blobs.vouch``)."""
    shard = next(llama_dir.glob("*.safetensors"))
    unchanged: dict[str, os.stat_result] = {}
    stream_tensors(llama_dir, source_tensors(llama_dir), lambda t, d: {}, 1, lambda n: None, None, None, unchanged)
    assert set(unchanged) == {shard.name}
    assert unchanged[shard.name].st_ino == shard.stat().st_ino

    touched: dict[str, os.stat_result] = {}

    def touch(t: SourceTensor, data: Buffer) -> dict[str, Any]:
        os.utime(shard, ns=(time.time_ns(), time.time_ns() + 1_000_000_000))  # changed while read
        return {}

    stream_tensors(llama_dir, source_tensors(llama_dir), touch, 1, lambda n: None, None, None, touched)
    assert touched == {}
