"""The blob store hashes bytes once: what it spilled and reads back unchanged is not hashed again,
an array read from it and stored again keeps its digest, and a spill file changed since is caught."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from qcompiler.errors import BlobError
from qcompiler.ir import blob_spill, blobs
from qcompiler.ir.core import BlobRef, Module, TensorDecl
from qcompiler.ir.dtypes import DTYPES


def counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = blobs.sha256_hex

    def count(data: bytes | memoryview) -> str:
        sizes.append(memoryview(data).nbytes)
        return real(data)

    monkeypatch.setattr(blobs, "sha256_hex", count)
    return sizes


def test_spilled_bytes_are_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arr = np.arange(4096, dtype=np.int8).reshape(64, 64)
    with blobs.spilled(tmp_path / "spill"):
        sizes = counting(monkeypatch)
        ref = blobs.put_array(arr, DTYPES["i8"])
        m = Module("m", tensors={"w": TensorDecl("w", ref, {})})
        assert sizes == [arr.nbytes]  # hashed while stored
        back = blobs.read_array(m, "w")
        assert np.array_equal(back, arr)
        assert sizes == [arr.nbytes]
        again = blobs.put_array(back, DTYPES["i8"])
        assert again == ref
        assert sizes == [arr.nbytes]
        blobs.put_array(back.astype(np.int16), DTYPES["i16"])
        assert sizes == [arr.nbytes, 2 * arr.nbytes]  # a converted array is new bytes


def test_a_spill_file_changed_since_it_was_written_is_hashed_and_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arr = np.arange(4096, dtype=np.int8)
    with blobs.spilled(tmp_path / "spill") as spill:
        ref = blobs.put_array(arr, DTYPES["i8"])
        m = Module("m", tensors={"w": TensorDecl("w", ref, {})})
        path = spill / ref.sha256
        st = path.stat()
        path.write_bytes(bytes(arr.nbytes))  # same length, other bytes
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        sizes = counting(monkeypatch)
        with pytest.raises(BlobError, match="sha256 mismatch"):
            blobs.read_array(m, "w")
        assert sizes == [arr.nbytes]


def rewritten(path: Path, data: bytes) -> None:
    """``path`` changed in place to ``data``, its mtime moved on: a file of another identity."""
    before = path.stat().st_mtime_ns
    path.write_bytes(data)
    os.utime(path, ns=(before + 1_000_000, before + 1_000_000))


def file_module(tmp_path: Path, arr: np.ndarray) -> Module:
    (tmp_path / "w.bin").write_bytes(arr.tobytes())
    ref = BlobRef(DTYPES["i8"], arr.shape, blobs.sha256_hex(arr.tobytes()), "file:w.bin")
    return Module("m", tensors={"w": TensorDecl("w", ref, {})}, base_dir=str(tmp_path))


def test_a_file_read_again_unchanged_is_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arr = np.arange(4096, dtype=np.int8).reshape(64, 64)
    m = file_module(tmp_path, arr)
    sizes = counting(monkeypatch)
    for _ in range(3):
        assert np.array_equal(blobs.read_array(m, "w"), arr)
    assert sizes == [arr.nbytes]


def test_a_file_changed_or_replaced_since_its_read_is_hashed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arr = np.arange(4096, dtype=np.int8).reshape(64, 64)
    m = file_module(tmp_path, arr)
    blobs.read_array(m, "w")
    sizes = counting(monkeypatch)
    # the same bytes under a new inode: read through a file of another identity, so hashed again
    (tmp_path / "w.tmp").write_bytes(arr.tobytes())
    os.replace(tmp_path / "w.tmp", tmp_path / "w.bin")
    assert np.array_equal(blobs.read_array(m, "w"), arr)
    assert sizes == [arr.nbytes]
    # changed in place (a new mtime): hashed again, and refused
    rewritten(tmp_path / "w.bin", (arr + 1).tobytes())
    with pytest.raises(BlobError, match="sha256 mismatch"):
        blobs.read_array(m, "w")
    assert sizes == [arr.nbytes, arr.nbytes]


def test_a_derived_blob_is_made_again_only_when_read(tmp_path: Path) -> None:
    arr = np.arange(-6, 6, dtype=np.int8).reshape(3, 4)
    made: list[int] = []

    def make() -> np.ndarray:
        made.append(1)
        return arr.copy()

    m = Module("m")
    with blobs.spilled(tmp_path / "spill"):
        ref, pending = blobs.hashed(arr, DTYPES["i8"])
        assert pending is not None
        blobs.derived(ref, make)
        assert not list((tmp_path / "spill").iterdir())  # no bytes were written
        assert blobs.in_store(ref.sha256)
        m.tensors["t"] = TensorDecl("t", ref)
        assert made == []
        assert np.array_equal(blobs.read_array(m, "t"), arr)
        assert made == [1]
    with pytest.raises(BlobError, match="not in this process"):  # the recipe ends with its spill directory
        blobs.read_array(m, "t")


def test_a_recipe_that_makes_other_bytes_is_refused(tmp_path: Path) -> None:
    arr = np.arange(12, dtype=np.int8).reshape(3, 4)
    with blobs.spilled(tmp_path / "spill"):
        ref, _ = blobs.hashed(arr, DTYPES["i8"])
        blobs.derived(ref, lambda: arr + 1)
        m = Module("m")
        m.tensors["t"] = TensorDecl("t", ref)
        with pytest.raises(BlobError, match="sha256 mismatch"):
            blobs.read_array(m, "t")


def test_a_full_spill_file_system_is_a_typed_error_naming_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC while the blob store spills (an 8B source's codes go there) is a ``BlobError`` naming
    the directory and the size, not an internal error, and leaves no temp file behind."""
    import errno

    def full(self: Path, *args: object, **kwargs: object) -> object:
        raise OSError(errno.ENOSPC, "No space left on device")

    with blobs.spilled(tmp_path):
        monkeypatch.setattr(Path, "open", full)
        with pytest.raises(BlobError, match=r"spill directory .*: cannot write 40 bytes \(No space left on device\)"):
            blobs.put_array(np.arange(10, dtype=np.float32) + 12345.5, DTYPES["f32"])
        monkeypatch.undo()
        assert not list(tmp_path.iterdir())


def test_a_safetensors_tensor_is_checked_a_piece_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_blob`` hashes a container tensor in pieces (an 8B model's 1 GB embedding is never held
    whole to be checked), records it as checked like ``read_blob`` does, and refuses changed bytes."""
    from safetensors.numpy import save_file

    from qcompiler.backends.safetensors import blobs as st_blobs
    from qcompiler.backends.safetensors.container import SafetensorsFile

    arr = np.arange(20 << 20, dtype=np.uint8).view(np.int8).reshape(5 << 10, 4 << 10)  # 20 MB: three pieces
    save_file({"w": arr}, str(tmp_path / "model.safetensors"))
    ref = BlobRef(DTYPES["i8"], arr.shape, blobs.sha256_hex(arr.tobytes()), "safetensors:model.safetensors#w")
    m = Module("m", tensors={"w": TensorDecl("w", ref, {})}, base_dir=str(tmp_path))
    assert st_blobs.SCHEMES[0] in blobs.PIECES
    seen: list[int] = []
    real = SafetensorsFile.pieces

    def whole(self: SafetensorsFile, name: str) -> bytes:
        raise AssertionError("check_blob read the whole tensor")

    def spy(self: SafetensorsFile, name: str, size: int = 8 << 20) -> Iterator[bytes]:
        for piece in real(self, name, size):
            seen.append(len(piece))
            yield piece

    monkeypatch.setattr(SafetensorsFile, "read", whole)
    monkeypatch.setattr(SafetensorsFile, "pieces", spy)
    blobs.check_blob(m.tensors["w"], m.base_dir)
    assert seen == [8 << 20, 8 << 20, 4 << 20]
    monkeypatch.undo()
    sizes = counting(monkeypatch)
    assert np.array_equal(blobs.read_array(m, "w"), arr)
    assert sizes == []  # checked already, from the same file
    path = tmp_path / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(BlobError, match=r"tensor @w: sha256 mismatch"):
        blobs.check_blob(m.tensors["w"], m.base_dir)


class Evicting(dict[tuple[str, str, int, int, int, int], object]):
    """A header table that another thread clears right after each store (the data checks run in threads)."""

    def __setitem__(self, key: tuple[str, str, int, int, int, int], value: object) -> None:
        super().__setitem__(key, value)
        self.clear()


def test_a_parsed_header_is_returned_even_when_the_table_is_cleared_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "c.bin").write_bytes(b"header")
    monkeypatch.setattr(blobs, "_PARSED", Evicting())

    def parse(path: Path, fh: object) -> str:
        return f"parsed {path.name}"

    assert blobs.open_cached(tmp_path, "c.bin", "test", parse) == "parsed c.bin"


def test_a_moved_blob_is_read_from_the_artifact_file_its_spill_file_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once an artifact file holds a spilled blob (``blob_spill.moved``), the spill file is removed
    and the blob is read from the artifact file, without hashing it again, through a descriptor
    that a rename of the file (the publish) does not disturb; it ends with its spill block."""
    arr = np.arange(8192, dtype=np.int16).reshape(64, 128)
    shard = tmp_path / "tmp" / "model.safetensors"
    shard.parent.mkdir()
    with blobs.spilled(tmp_path / "spill") as spill:
        ref = blobs.put_array(arr, DTYPES["i16"])
        m = Module("m", tensors={"w": TensorDecl("w", ref, {})})
        shard.write_bytes(b"head" + arr.tobytes() + b"tail")
        assert blob_spill.moved(ref.sha256, shard, 4)
        assert not (spill / ref.sha256).exists()
        assert not blob_spill.moved(ref.sha256, shard, 4)  # moved once
        assert blobs.in_store(ref.sha256)
        (tmp_path / "tmp").rename(tmp_path / "published")
        sizes = counting(monkeypatch)
        assert np.array_equal(blobs.read_array(m, "w"), arr)
        assert sizes == []
    with pytest.raises(BlobError, match="not in this process"):
        blobs.read_array(m, "w")
    assert blob_spill.MOVED == {}
    assert blob_spill.OPEN == {}


def test_only_a_file_of_the_spill_moves(tmp_path: Path) -> None:
    arr = np.arange(64, dtype=np.int8)
    ref = blobs.put_array(arr, DTYPES["i8"])  # in memory: no spill is active
    assert not blob_spill.moved(ref.sha256, tmp_path / "f", 0)
    with blobs.spilled(tmp_path / "spill"):
        assert not blob_spill.moved(ref.sha256, tmp_path / "f", 0)  # not a file of this spill
        assert blob_spill.MOVED == {}


def test_a_vouched_location_is_not_hashed_again_until_its_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``vouch``: bytes the caller hashed as it read them from a file are not hashed again when read
    from that same file; a file changed since (a new mtime) is hashed again, and refused."""
    arr = np.arange(4096, dtype=np.int8).reshape(64, 64)
    m = file_module(tmp_path, arr)
    ref = m.tensors["w"].blob
    blobs.vouch(ref.location, m.base_dir, "w.bin", ref.sha256, (tmp_path / "w.bin").stat())
    sizes = counting(monkeypatch)
    assert np.array_equal(blobs.read_array(m, "w"), arr)
    assert sizes == []
    rewritten(tmp_path / "w.bin", (arr + 1).tobytes())
    with pytest.raises(BlobError, match="sha256 mismatch"):
        blobs.read_array(m, "w")
    assert sizes == [arr.nbytes]


def shard_module(tmp_path: Path, arr: np.ndarray) -> Module:
    from safetensors.numpy import save_file

    save_file({"w": arr}, str(tmp_path / "x.safetensors"))
    ref = BlobRef(DTYPES["i8"], arr.shape, blobs.sha256_hex(arr.tobytes()), "safetensors:x.safetensors#w")
    return Module("m", tensors={"w": TensorDecl("w", ref, {})}, base_dir=str(tmp_path))


def test_read_pieces_checks_the_whole_and_skips_the_hash_of_a_vouched_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``read_pieces`` gives a tensor a few MB at a time, its length and sha256 checked after the last
    piece; from a file a hash was taken of (``vouch``) it hashes nothing, until the file changes."""
    from qcompiler.backends.safetensors import container

    monkeypatch.setattr(container.SafetensorsFile.pieces, "__defaults__", (1000,))  # 1000-byte pieces
    arr = np.arange(4096, dtype=np.int8).reshape(64, 64)
    m = shard_module(tmp_path, arr)
    decl = m.tensors["w"]
    pieces = list(blobs.read_pieces(decl, m.base_dir))
    assert [len(p) for p in pieces] == [1000] * 4 + [96]
    assert b"".join(pieces) == arr.tobytes()
    path = tmp_path / "x.safetensors"
    blobs.vouch(decl.blob.location, m.base_dir, "x.safetensors", decl.blob.sha256, path.stat())
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the tensor's last byte: the header stays valid
    with path.open("r+b") as fh:  # the same inode and size, its mtime put back: the identity vouched for
        fh.write(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert b"".join(blobs.read_pieces(decl, m.base_dir)) == bytes(raw[-4096:])  # trusted: not hashed
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # now another identity: hashed, refused
    got = blobs.read_pieces(decl, m.base_dir)
    with pytest.raises(BlobError, match="sha256 mismatch"):
        list(got)


def test_a_tensor_written_in_pieces_must_have_its_length() -> None:
    from qcompiler.backends.safetensors.container_write import TensorBytes, serialize
    from qcompiler.errors import QcError

    ok = TensorBytes("w", "I8", (4, 4), lambda: iter([b"\0" * 10, b"\0" * 6]))
    assert b"".join(serialize([ok]))[-16:] == b"\0" * 16
    short = TensorBytes("w", "I8", (4, 4), lambda: iter([b"\0" * 10, b"\0" * 5]))
    with pytest.raises(QcError, match="data length does not match"):
        b"".join(serialize([short]))
