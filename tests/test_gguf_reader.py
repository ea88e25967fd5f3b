"""The strict GGUF reader: agreement with gguf-py on well-formed files, and one malformed file per rejection class.

Malformed files come from a small byte-level writer (``build``) so each case corrupts exactly one field of an
otherwise valid file. Each case id carries gguf-py 0.19's verdict on that file (``py-ok``: gguf-py accepts it,
``py-err``: it raises, ``py-hang``: it loops for a very long time), measured when the case was written; the
test records gguf-py's live verdict as a property but asserts only our own behaviour.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import struct
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import pytest

from qcompiler.backends.gguf import reader as gguf_reader
from qcompiler.backends.gguf.ggml_types import BLOCKS, GGMLType
from qcompiler.backends.gguf.reader import GGUFError, GGUFFile, open_gguf

T = gguf.GGMLQuantizationType
V = gguf.GGUFValueType

# ---------------------------------------------------------------------------------------------- byte-level writer


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return u64(len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


ARCH = kv("general.architecture", V.STRING, gstr("llama"))


@dataclass(frozen=True)
class Tensor:
    """A tensor info plus its data; ``offset=None`` packs it after the previous one, ``data=None`` zero-fills."""

    name: bytes = b"a"
    ne: tuple[int, ...] = (8,)
    type_id: int = 0
    offset: int | None = None
    data: bytes | None = None
    raw_name: bytes | None = None  # replaces the whole gguf_string of the name

    def nbytes(self) -> int:
        if self.type_id not in BLOCKS:
            return 0
        block, size = BLOCKS[GGMLType(self.type_id)]
        return math.prod(self.ne) // block * size


@dataclass(frozen=True)
class Spec:
    """A whole file. The defaults make a valid one: one string kv, F32 tensors a (8,) and b (4,), alignment 32."""

    magic: bytes = b"GGUF"
    version: int = 3
    tensor_count: int | None = None
    kv_count: int | None = None
    kvs: tuple[bytes, ...] = (ARCH,)
    tensors: tuple[Tensor, ...] = (Tensor(b"a", (8,)), Tensor(b"b", (4,)))
    alignment: int = 32  # the layout alignment; a general.alignment kv is added separately
    tail: bytes = b""
    cut: int = 0  # bytes removed from the end


def pad(n: int, alignment: int) -> int:
    return -n % alignment


def build(spec: Spec) -> bytes:
    tensor_count = len(spec.tensors) if spec.tensor_count is None else spec.tensor_count
    kv_count = len(spec.kvs) if spec.kv_count is None else spec.kv_count
    out = bytearray(spec.magic + u32(spec.version) + u64(tensor_count) + u64(kv_count))
    out += b"".join(spec.kvs)
    offset = 0
    for t in spec.tensors:
        out += t.raw_name if t.raw_name is not None else gstr(t.name)
        out += u32(len(t.ne)) + b"".join(u64(n) for n in t.ne) + u32(t.type_id)
        out += u64(offset if t.offset is None else t.offset)
        offset += t.nbytes() + pad(t.nbytes(), spec.alignment)
    out += bytes(pad(len(out), spec.alignment))
    for t in spec.tensors:
        data = bytes(t.nbytes()) if t.data is None else t.data
        out += data + bytes(pad(len(data), spec.alignment))
    out += spec.tail
    return bytes(out[: len(out) - spec.cut])


def prefix_until_b_n_dims() -> bytes:
    """A valid file cut two bytes into tensor b's n_dims."""
    whole = build(Spec())
    at = whole.index(gstr("b")) + len(gstr("b"))
    return whole[: at + 2]


# ---------------------------------------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class Case:
    id: str
    file: Spec | Callable[[], bytes]
    field: str
    phrase: str
    gguf_py: str  # gguf-py 0.19's verdict: "py-ok", "py-err" or "py-hang"
    options: dict[str, int] = dataclasses.field(default_factory=dict[str, int])


def tensors(*ts: Tensor) -> Spec:
    return Spec(tensors=ts)


def kvs(*items: bytes) -> Spec:
    return Spec(kvs=(ARCH, *items))


A, B = Tensor(b"a", (8,)), Tensor(b"b", (4,))
# fmt: off
CASES = [
    # 1. header
    Case("short-file", lambda: b"GGUF" + u32(3) + bytes(6), "size", "too small", "py-err"),
    Case("bad-magic", Spec(magic=b"GGML"), "magic", "not a GGUF file", "py-err"),
    Case("version-2", Spec(version=2), "version", "(expected 3, found 2)", "py-ok"),
    Case("version-4", Spec(version=4), "version", "unsupported GGUF version", "py-err"),
    Case("version-byte-swapped", Spec(version=0x03000000), "version", "byte-swapped", "py-err"),
    # 2. counts
    Case("tensor-count-2**62", Spec(tensor_count=2**62), "tensor_count", "too many tensors", "py-err"),
    Case("tensor-count-negative", Spec(tensor_count=2**64 - 1), "tensor_count", "as int64", "py-err"),
    Case("tensor-count-past-eof", Spec(tensor_count=1000), "tensor_count", "more tensors than the file", "py-err"),
    Case("kv-count-2**62", Spec(kv_count=2**62), "kv_count", "too many key-value pairs", "py-err"),
    Case("kv-count-past-eof", Spec(kv_count=100), "kv_count", "more key-value pairs than the file", "py-err"),
    Case("kv-count-over-cap", Spec(), "kv_count", "too many key-value pairs", "py-ok", {"max_kv": 0}),
    Case("tensor-count-over-cap", Spec(), "tensor_count", "too many tensors", "py-ok", {"max_tensors": 1}),
    # 3. strings and keys
    Case("key-length-2**62", Spec(kvs=(u64(2**62) + b"k",)), "string length", "key too long", "py-err"),
    Case("key-length-past-eof", Spec(kvs=(u64(5000) + b"general.name",)), "string length", "past the end", "py-err"),
    Case("string-length-2**60", kvs(kv("x.s", V.STRING, u64(2**60) + b"abc")), "string length",
         "string too long", "py-err"),
    Case("string-length-past-eof", kvs(kv("x.s", V.STRING, u64(900) + b"abc")), "string length", "past the end",
         "py-err"),
    Case("string-over-cap", Spec(), "string length", "key too long", "py-ok", {"max_string": 4}),
    Case("key-not-utf8", kvs(kv(b"x.\xff", V.UINT32, u32(1))), "key", "invalid UTF-8", "py-err"),
    Case("string-not-utf8", kvs(kv("x.s", V.STRING, gstr(b"\xc3\x28"))), "string", "invalid UTF-8", "py-ok"),
    Case("key-empty", kvs(kv(b"", V.UINT32, u32(1))), "key", "empty key", "py-ok"),
    Case("key-duplicate", kvs(ARCH), "key", "duplicate key", "py-err"),
    # 4. value types and arrays
    Case("value-type-13", kvs(kv("x.v", 13, u32(0))), "value_type", "unknown value type", "py-err"),
    Case("value-truncated", lambda: b"GGUF" + u32(3) + u64(0) + u64(2) + ARCH + kv("x.v", V.UINT64, u32(1)),
         "value", "unexpected end of file", "py-err"),
    Case("array-nested", kvs(kv("x.a", V.ARRAY, u32(V.ARRAY) + u64(1) + u32(V.UINT32) + u64(1) + u32(7))),
         "array element type", "nested arrays", "py-ok"),
    Case("array-element-type-77", kvs(kv("x.a", V.ARRAY, u32(77) + u64(1) + u32(0))), "array element type",
         "unknown value type", "py-err"),
    Case("array-count-2**62", kvs(kv("x.a", V.ARRAY, u32(V.UINT8) + u64(2**62))), "array count", "too long",
         "py-hang"),
    Case("array-count-past-eof", kvs(kv("x.a", V.ARRAY, u32(V.UINT32) + u64(1000) + u32(1) * 3)), "array count",
         "past the end", "py-err"),
    Case("string-array-count-past-eof", kvs(kv("x.a", V.ARRAY, u32(V.STRING) + u64(10**6))), "array count",
         "past the end", "py-err"),
    Case("string-array-item-past-eof", kvs(kv("x.a", V.ARRAY, u32(V.STRING) + u64(2) + gstr("ok") + u64(4000))),
         "string length", "x.a[1]: string length: string runs past the end", "py-err"),
    # 5. bool
    Case("bool-2", kvs(kv("x.b", V.BOOL, b"\x02")), "bool", "must be 0 or 1", "py-ok"),
    Case("bool-array-2", kvs(kv("x.b", V.ARRAY, u32(V.BOOL) + u64(3) + b"\x00\x01\x02")), "bool",
         "x.b[2]: bool", "py-ok"),
    # 6. general.alignment
    Case("alignment-u64", kvs(kv("general.alignment", V.UINT64, u64(32))), "general.alignment", "wrong value type",
         "py-err"),
    Case("alignment-0", kvs(kv("general.alignment", V.UINT32, u32(0))), "general.alignment", "power of two",
         "py-err"),
    Case("alignment-48", kvs(kv("general.alignment", V.UINT32, u32(48))), "general.alignment", "power of two",
         "py-err"),
    Case("alignment-2**24", kvs(kv("general.alignment", V.UINT32, u32(2**24))), "general.alignment", "too large",
         "py-err"),
    # 7. tensor infos
    Case("name-empty", tensors(Tensor(b""), B), "name", "empty tensor name", "py-ok"),
    Case("name-64-bytes", tensors(Tensor(b"n" * 64), B), "name", "name too long", "py-ok"),
    Case("name-length-2**62", tensors(Tensor(raw_name=u64(2**62) + b"a"), B), "name", "name too long", "py-err"),
    Case("name-duplicate", tensors(A, Tensor(b"a", (4,))), "name", "duplicate tensor name", "py-err"),
    Case("name-not-utf8", tensors(Tensor(b"\xff\xfe"), B), "name", "invalid UTF-8", "py-err"),
    Case("n-dims-0", tensors(A, Tensor(b"b", ())), "n_dims", "bad number of dimensions", "py-ok"),
    Case("n-dims-5", tensors(A, Tensor(b"b", (4, 1, 1, 1, 1))), "n_dims", "bad number of dimensions", "py-ok"),
    Case("ne-zero", tensors(A, Tensor(b"b", (4, 0))), "ne", "ne[1] must be positive", "py-ok"),
    Case("ne-negative", tensors(A, Tensor(b"b", (2**64 - 4,), data=b"")), "ne", "as int64", "py-err"),
    Case("ne-product-overflow", tensors(A, Tensor(b"b", (2**32, 2**32), data=b"")), "ne",
         "element count overflows int64", "py-err"),
    Case("byte-size-overflow", tensors(A, Tensor(b"b", (2**62,), data=b"")), "size", "byte size overflows int64",
         "py-err"),
    Case("tensor-larger-than-file", tensors(A, Tensor(b"b", (2**20,), data=b"")), "size",
         "larger than the whole file", "py-err"),
    Case("type-removed-4", tensors(A, Tensor(b"b", (32,), type_id=4)), "type", "removed ggml type", "py-err"),
    Case("type-removed-36", tensors(A, Tensor(b"b", (32,), type_id=36)), "type", "removed ggml type", "py-err"),
    Case("type-unknown-43", tensors(A, Tensor(b"b", (32,), type_id=43)), "type", "unknown ggml type", "py-err"),
    Case("type-unknown-99", tensors(A, Tensor(b"b", (32,), type_id=99)), "type", "unknown ggml type", "py-err"),
    Case("q8_0-ne0-not-block-multiple", tensors(A, Tensor(b"b", (48,), type_id=T.Q8_0, data=b"")), "ne",
         "not a multiple of the Q8_0 block size", "py-err"),
    # 8. offsets and file size
    Case("offset-misaligned", tensors(A, Tensor(b"b", (4,), offset=48)), "offset", "misaligned", "py-ok"),
    Case("offset-overlap", tensors(A, Tensor(b"b", (4,), offset=0)), "offset", "overlaps tensor 'a'", "py-ok"),
    Case("offset-out-of-order", tensors(Tensor(b"a", (8,), offset=32), Tensor(b"b", (4,), offset=0)), "offset",
         "out of order", "py-ok"),
    Case("offset-gap", Spec(tensors=(A, Tensor(b"b", (4,), offset=64)), tail=bytes(32)), "offset",
         "gap after tensor 'a'", "py-ok"),
    Case("offset-gap-first", Spec(tensors=(Tensor(b"a", (8,), offset=32), Tensor(b"b", (4,), offset=64)),
                                  tail=bytes(32)), "offset", "gap before the first tensor", "py-ok"),
    Case("data-truncated", Spec(cut=20), "size", "b: size: tensor data runs past the end of the file", "py-err"),
    Case("last-padding-missing", Spec(cut=8), "size", "file ends inside the padding", "py-ok"),
    Case("trailing-bytes", Spec(tail=bytes(32)), "size", "trailing bytes", "py-ok"),
    Case("trailing-bytes-no-tensors", Spec(tensors=(), tail=b"x" * 40), "size", "trailing bytes", "py-ok"),
    Case("eof-in-tensor-info", prefix_until_b_n_dims, "n_dims", "unexpected end of file", "py-err"),
]
# fmt: on


def case_bytes(case: Case) -> bytes:
    return build(case.file) if isinstance(case.file, Spec) else case.file()


def gguf_py_verdict(path: Path) -> str:
    try:
        gguf.GGUFReader(path)
    except Exception:
        return "py-err"
    return "py-ok"


@pytest.mark.parametrize("case", CASES, ids=[f"{c.id}[{c.gguf_py}]" for c in CASES])
def test_malformed_file_is_rejected(case: Case, tmp_path: Path, record_property: Callable[[str, object], None]):
    path = tmp_path / f"{case.id}.gguf"
    path.write_bytes(case_bytes(case))
    with pytest.raises(GGUFError) as info:
        open_gguf(path, **cast(dict[str, Any], case.options))  # limits only, never fh
    error = info.value
    assert error.field == case.field, str(error)
    assert case.phrase in str(error)
    assert str(error).startswith(f"{path}: ")
    if case.gguf_py != "py-hang" and not case.options:
        record_property("gguf_py_live", gguf_py_verdict(path))


def test_corpus_baseline_is_valid(tmp_path: Path):
    """Every case is one corruption away from this file, which both readers accept."""
    path = tmp_path / "base.gguf"
    path.write_bytes(build(Spec()))
    f = open_gguf(path)
    assert list(f.tensors) == ["a", "b"]
    assert (f.tensors["b"].offset, f.data_start % 32, f.size) == (32, 0, f.data_start + 64)
    assert gguf_py_verdict(path) == "py-ok"


def test_no_tensors_needs_no_padding(tmp_path: Path):
    whole = build(Spec(tensors=()))
    unpadded = whole.rstrip(b"\x00")
    assert len(unpadded) < len(whole)
    for data in (whole, unpadded):
        path = tmp_path / "x.gguf"
        path.write_bytes(data)
        assert open_gguf(path).tensors == {}


def test_error_renders_file_where_field_expected_found(tmp_path: Path):
    path = tmp_path / "x.gguf"
    path.write_bytes(build(kvs(kv("x.b", V.BOOL, b"\x02"))))
    with pytest.raises(GGUFError) as info:
        open_gguf(path)
    assert str(info.value) == f"{path}: x.b: bool: bool byte must be 0 or 1 (expected 0 or 1, found 2)"
    assert (info.value.where, info.value.expected, info.value.found) == ("x.b", "0 or 1", "2")


@pytest.mark.parametrize(
    "spec",
    [Spec(tensor_count=2**62), Spec(kv_count=2**62), Spec(kvs=(u64(2**62) + b"k",)),
     kvs(kv("x.a", V.ARRAY, u32(V.STRING) + u64(2**30))), tensors(Tensor(raw_name=u64(2**62) + b"a"))],
    ids=["tensors", "kvs", "key", "string-array", "name"],
)  # fmt: skip
def test_huge_counts_fail_fast_without_allocating(spec: Spec, tmp_path: Path):
    path = tmp_path / "x.gguf"
    path.write_bytes(build(spec))
    tracemalloc.start()
    with pytest.raises(GGUFError):
        open_gguf(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20  # how fast the refusal is: bench/reject_huge_headers.py, never a test


# ---------------------------------------------------------------------------------------------- gguf-py files


def write_model(path: Path, alignment: int) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.strs", ["a", "", "ünï"])
    w.add_array("t.floats", [0.5, 0.1])
    w.add_array("t.bools", [True, False])
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16.3d", rng.standard_normal((2, 3, 4)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    for name, qtype, shape in [("q8_0", T.Q8_0, (4, 64)), ("q4_0", T.Q4_0, (3, 32)), ("q8_0.3d", T.Q8_0, (2, 3, 32))]:
        data = rng.standard_normal(shape).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(params=[32, 64], ids=["align32", "align64"])
def model(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[GGUFFile, gguf.GGUFReader]:
    path = tmp_path / "model.gguf"
    write_model(path, request.param)
    return open_gguf(path), gguf.GGUFReader(path)


def test_metadata_agrees_with_gguf_py(model: tuple[GGUFFile, gguf.GGUFReader]):
    ours, ref = model
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, f in fields.items():
        vtype, value = ours.metadata[key]
        assert vtype == f.types[0], key
        assert value == f.contents(), key
        if vtype == V.ARRAY:
            assert ours.array_types[key] == f.types[-1], key
    assert ours.metadata["t.bools"] == (V.ARRAY, [True, False])
    assert ours.metadata["t.true"] == (V.BOOL, True)
    assert ours.alignment == ours.metadata["general.alignment"][1] == ref.alignment
    assert ours.data_start == ref.data_offset


def test_tensors_agree_with_gguf_py(model: tuple[GGUFFile, gguf.GGUFReader]):
    ours, ref = model
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ne == tuple(t.shape.tolist())
        assert info.shape == info.ne[::-1]
        assert (info.type_id, info.nbytes) == (t.tensor_type, t.n_bytes)
        assert ours.data_start + info.offset == t.data_offset
        assert ours.read(t.name) == t.data.tobytes()
        arr = ours.array(t.name)
        assert (arr.shape, arr.dtype) == (t.data.shape, t.data.dtype), t.name
        assert arr.tobytes() == t.data.tobytes()
        assert not arr.flags.writeable
    assert ours.tensors["q8_0"].shape == (4, 64)
    assert ours.array("q8_0").shape == (4, 2 * 34)


def test_unknown_tensor_and_changed_file(tmp_path: Path):
    path = tmp_path / "model.gguf"
    write_model(path, 32)
    f = open_gguf(path)
    with pytest.raises(GGUFError, match="no such tensor") as info:
        f.read("missing")
    assert info.value.field == "name"
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    g = open_gguf(copy)
    os.truncate(copy, g.data_start + g.tensors["f32"].offset + 8)
    with pytest.raises(GGUFError, match="file truncated since it was opened"):
        g.read("f32")
    with pytest.raises(GGUFError, match="changed size"):
        g.array("f32")


# ---------------------------------------------------------------------------------------------- the module itself


def test_reader_is_small_and_standalone():
    source = Path(gguf_reader.__file__).read_text()
    assert len(source.splitlines()) <= 400
    assert "import gguf" not in source
