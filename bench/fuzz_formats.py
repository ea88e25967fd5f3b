"""Container-aware mutators of ``bench/fuzz.py``: safetensors header entries, GGUF key-value and
tensor-info records, ONNX protobuf fields. Each parses the file, edits one field (to a valid-looking
or an invalid value), and writes the file back with everything else byte for byte as it was."""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass, field
from typing import Any

from fuzz_mutators import HUGE_INTS, SMALL_INTS, Ctx, Mutation, dump, files_of, interesting, mutate_json, nodes

# ---------------------------------------------------------------------------------------------- safetensors

ST_DTYPES = ["F32", "F16", "BF16", "I32", "I64", "I8", "U8", "F64", "BOOL", "F4", "f32", "Q4_0", ""]


def st_mutator(ctx: Ctx) -> Mutation:
    """One edit of a safetensors header: an entry's dtype/shape/data_offsets, a name, ``__metadata__``,
    the length prefix, or any JSON edit; the header is re-padded to 8 bytes."""
    rng = ctx.rng
    rel = rng.choice([f for f in files_of(ctx.root) if f.endswith(".safetensors")])
    path = ctx.root / rel
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header: dict[str, Any] = json.loads(data[8 : 8 + n])
    buffer = data[8 + n :]
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    op = rng.choice(["dtype", "shape", "shape", "offsets", "offsets", "rename", "swap", "metadata", "prefix", "json"])
    where, prefix = f"header {op}", None
    if op == "dtype":
        old = entry["dtype"]
        entry["dtype"] = rng.choice(ST_DTYPES)
        detail = f"{name}.dtype {old} -> {entry['dtype']}"
    elif op == "shape":
        old = list(entry["shape"])
        entry["shape"] = new_shape(old, rng)
        detail = f"{name}.shape {old} -> {entry['shape']}"
    elif op == "offsets":
        old = list(entry["data_offsets"])
        b, e = old
        entry["data_offsets"] = rng.choice(
            [[b, e + 1], [b + 1, e], [b - 1 if b else 1, e], [e, b], [0, e - b], [b, 2**64], [b, e, e], [b + 8, e + 8]]
        )
        detail = f"{name}.data_offsets {old} -> {entry['data_offsets']}"
    elif op == "rename":
        new = rng.choice([rng.choice(names) + "x", "", "x" * 1100, name.upper(), name + "\u0301", "__metadata__"])
        header[new] = header.pop(name)
        detail = f"tensor {name} renamed {new[:40]!r}"
    elif op == "swap":
        same = [m for m in names if m != name and header[m]["shape"] == entry["shape"]]
        other = rng.choice(same or names)
        header[name], header[other] = header[other], header[name]
        where = "header swap same-shape entries" if same else "header swap entries"
        detail = f"entries of {name} and {other} swapped"
    elif op == "metadata":
        meta = header.get("__metadata__")
        choice = rng.choice([{"format": "tf"}, {"format": 1}, None, [], {"format": "pt", "x": "\ud800"}, {}, "pt"])
        header["__metadata__"] = choice
        detail = f"__metadata__ {meta} -> {choice!r}"
    elif op == "prefix":
        prefix = rng.choice([n + 1, n - 1, n + 8, 0, 2**63, 8, len(data)])
        detail = f"header length {n} -> {prefix}"
    else:
        new_header, where, detail = mutate_json(header, rng, nodes(header))
        where = f"header json {where}"
        header = new_header if isinstance(new_header, dict) else {"x": new_header}
    text = (dump(header) if op == "json" else json.dumps(header, separators=(",", ":"))).encode(
        "utf-8", "surrogatepass"
    )
    text += b" " * (-len(text) % 8)
    prefix = len(text) if prefix is None else prefix
    path.write_bytes(prefix.to_bytes(8, "little") + text + buffer)
    return Mutation("st-header", rel, f"{rel} {where}", detail)


def new_shape(old: list[int], rng: random.Random) -> Any:
    i = rng.randrange(len(old)) if old else 0
    edits: list[Any] = [
        [*old[:i], old[i] + 1, *old[i + 1 :]] if old else [1],
        [*old[:i], old[i] * 2, *old[i + 1 :]] if old else [2],
        old[::-1],
        [*old, 1],
        old[:-1],
        [0, *old[1:]],
        [2**40, 2**40],
        [-1, *old[1:]],
        [float(d) for d in old],
        [1] * 9,
        str(old),
    ]
    return rng.choice(edits)


# ---------------------------------------------------------------------------------------------- GGUF

SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass
class GKV:
    key: bytes
    vtype: int
    raw: bytes
    """The value's bytes as stored (after the u32 type)."""


@dataclass
class GInfo:
    name: bytes
    ne: list[int]
    gtype: int
    offset: int


@dataclass
class GGUF:
    version: int
    kvs: list[GKV]
    infos: list[GInfo]
    alignment: int
    data: bytes
    counts: list[int | None] = field(default_factory=lambda: [None, None])
    """Overrides of the header's tensor and kv counts (``None``: the true count)."""

    def serialize(self) -> bytes:
        n_t = len(self.infos) if self.counts[0] is None else self.counts[0]
        n_kv = len(self.kvs) if self.counts[1] is None else self.counts[1]
        out = bytearray(b"GGUF" + struct.pack("<I", self.version) + u64(n_t) + u64(n_kv))
        for kv in self.kvs:
            out += u64(len(kv.key)) + kv.key + struct.pack("<I", kv.vtype & 0xFFFFFFFF) + kv.raw
        for t in self.infos:
            out += u64(len(t.name)) + t.name + struct.pack("<I", len(t.ne) & 0xFFFFFFFF)
            out += b"".join(u64(d) for d in t.ne) + struct.pack("<I", t.gtype & 0xFFFFFFFF) + u64(t.offset)
        out += bytes(-len(out) % self.alignment)
        return bytes(out) + self.data


def u64(n: int) -> bytes:
    return (n % 2**64).to_bytes(8, "little")


def parse_gguf(data: bytes) -> tuple[GGUF, list[tuple[int, str]]]:
    """The records of a well-formed GGUF file, and (start offset, region name) of each record."""
    pos = 24
    regions: list[tuple[int, str]] = [(0, "header")]
    n_t, n_kv = struct.unpack_from("<QQ", data, 8)

    def take_string() -> bytes:
        nonlocal pos
        n = struct.unpack_from("<Q", data, pos)[0]
        pos += 8 + n
        return data[pos - n : pos]

    def value_size(vtype: int, at: int) -> int:
        if vtype == STRING:
            return 8 + struct.unpack_from("<Q", data, at)[0]
        if vtype == ARRAY:
            etype, count = struct.unpack_from("<IQ", data, at)
            size, cur = 12, at + 12
            for _ in range(count):
                step = value_size(etype, cur)
                size, cur = size + step, cur + step
            return size
        return struct.calcsize(SCALAR[vtype])

    kvs: list[GKV] = []
    for _ in range(n_kv):
        start = pos
        key = take_string()
        vtype = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        size = value_size(vtype, pos)
        kvs.append(GKV(key, vtype, data[pos : pos + size]))
        regions.append((start, f"kv {key.decode()}"))
        pos += size
    infos: list[GInfo] = []
    for _ in range(n_t):
        start = pos
        name = take_string()
        n_dims = struct.unpack_from("<I", data, pos)[0]
        ne = list(struct.unpack_from(f"<{n_dims}Q", data, pos + 4))
        pos += 4 + 8 * n_dims
        gtype, offset = struct.unpack_from("<IQ", data, pos)
        pos += 12
        infos.append(GInfo(name, ne, gtype, offset))
        regions.append((start, "tensor info"))
    align = next((struct.unpack("<I", kv.raw)[0] for kv in kvs if kv.key == b"general.alignment"), 32)
    data_start = pos + (-pos % align)
    regions.append((pos, "padding before data"))
    ordered = sorted(infos, key=lambda t: t.offset)
    for t in ordered:
        regions.append((data_start + t.offset, f"data of {t.name.decode()}"))
    return GGUF(3, kvs, infos, align, data[data_start:]), regions


def gguf_region(data: bytes, at: int) -> str:
    try:
        _, regions = parse_gguf(data)
    except (struct.error, KeyError, UnicodeDecodeError):
        return "unparsed"
    name = "header"
    for start, region in regions:
        if start <= at:
            name = region
    return "tensor data" if name.startswith("data of") else name


GGML_TYPES = [0, 1, 2, 3, 6, 7, 8, 9, 10, 12, 14, 16, 24, 26, 30, 4, 39, 99, 2**32 - 1]
NEW_KEYS = [
    ("general.alignment", 4, struct.pack("<I", 64)),
    ("general.alignment", 4, struct.pack("<I", 3)),
    ("llama.expert_count", 4, struct.pack("<I", 8)),
    ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + u64(1) + b"a" + u64(1) + b"b"),
    ("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 2**40)),
    ("tokenizer.ggml.bos_token_id", 4, struct.pack("<I", 2**31)),
    ("x", 9, struct.pack("<IQ", 9, 1)),
]


def gguf_kv_mutator(ctx: Ctx) -> Mutation:
    """One edit of a GGUF header count or key-value record (value, type, key, count)."""
    rng, path = ctx.rng, ctx.root / "model.gguf"
    g, _ = parse_gguf(path.read_bytes())
    kv = rng.choice(g.kvs)
    key = kv.key.decode()
    op = rng.choice(["value", "value", "value", "type", "retype", "key", "delete", "dup", "add", "count", "version"])
    where = f"kv {key} {op}"
    if op == "value":
        old = kv.raw
        kv.raw = new_value(kv.vtype, kv.raw, rng)
        detail = f"{key} = {old[:16].hex()} -> {kv.raw[:16].hex()}"
    elif op == "type":
        old_type, kv.vtype = kv.vtype, rng.choice([t for t in range(14) if t != kv.vtype] + [2**31])
        detail = f"{key} value type {old_type} -> {kv.vtype}, bytes kept"
    elif op == "retype":
        old_type, kv.vtype = kv.vtype, rng.choice([t for t in SCALAR if t != kv.vtype] + [STRING])
        value = value_of(old_type, kv.raw)
        kv.raw = encode(kv.vtype, value)
        detail = f"{key} re-encoded as type {kv.vtype} ({value!r})"
    elif op == "key":
        kv.key = rng.choice([g.kvs[0].key, kv.key + b"x", b"", kv.key.upper(), kv.key + b"\xff", b"k" * 70_000])
        detail = f"key {key} -> {kv.key[:40]!r}"
    elif op == "delete":
        g.kvs.remove(kv)
        detail = f"{key} deleted"
    elif op == "dup":
        g.kvs.insert(g.kvs.index(kv) + 1, GKV(kv.key, kv.vtype, kv.raw))
        detail = f"{key} written twice"
    elif op == "add":
        name, vtype, raw = rng.choice(NEW_KEYS)
        g.kvs.append(GKV(name.encode(), vtype, raw))
        where, detail = f"kv add {name}", f"{name} (type {vtype}) added"
    elif op == "count":
        i = rng.randrange(2)
        true = [len(g.infos), len(g.kvs)][i]
        g.counts[i] = rng.choice([true + 1, true - 1, 0, 2**63, 2**64 - 1])
        where, detail = f"header {['tensor_count', 'kv_count'][i]}", f"{true} -> {g.counts[i]}"
    else:
        g.version = rng.choice([2, 4, 0x03000000, 0])
        where, detail = "header version", f"3 -> {g.version}"
    path.write_bytes(g.serialize())
    return Mutation("gguf-kv", "model.gguf", where, detail)


def value_of(vtype: int, raw: bytes) -> Any:
    if vtype == STRING:
        return raw[8:].decode("utf-8", "replace")
    if vtype in SCALAR:
        return struct.unpack(SCALAR[vtype], raw)[0]
    return 0


def encode(vtype: int, value: Any) -> bytes:
    if vtype == STRING:
        b = str(value).encode()
        return u64(len(b)) + b
    fmt = SCALAR[vtype]
    if fmt[-1] in "fd":
        return struct.pack(fmt, float(value) if isinstance(value, int | float) else 1.0)
    bits = struct.calcsize(fmt) * 8
    v = int(value) if isinstance(value, int | float) and value == value and abs(value) < 2**64 else 1
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if fmt[-1].islower() else (0, 2**bits - 1)
    return struct.pack(fmt, min(hi, max(lo, v)))


def new_value(vtype: int, raw: bytes, rng: random.Random) -> bytes:
    old = value_of(vtype, raw)
    if vtype == STRING:
        return rng.choice(
            [encode(STRING, old + "x"), encode(STRING, ""), u64(2) + b"\xff\xfe", encode(STRING, "gpt2"), u64(2**40)]
        )
    if vtype == 7:
        return rng.choice([b"\x02", b"\x00", b"\x01"])
    if SCALAR.get(vtype, "<B")[-1] in "fd":
        v = rng.choice([float("nan"), float("inf"), 0.0, -1.0, old * 2, old * 1.0001, 1e-30])
        return struct.pack(SCALAR[vtype], v)
    return encode(vtype, rng.choice([*SMALL_INTS, *HUGE_INTS, old + 1, old - 1, old * 2, old // 2]))


def gguf_tensor_mutator(ctx: Ctx) -> Mutation:
    """One edit of a GGUF tensor-info record (dims, type, offset, name), or of one tensor's bytes."""
    rng, path = ctx.rng, ctx.root / "model.gguf"
    g, regions = parse_gguf(path.read_bytes())
    t = rng.choice(g.infos)
    name = t.name.decode()
    op = rng.choice(["ne", "ne", "ndims", "type", "type", "offset", "offset", "name", "swap", "data"])
    where = f"tensor info {op}"
    if op == "ne":
        old = list(t.ne)
        shape = new_shape(old, rng)
        t.ne = [int(d) % 2**64 if isinstance(d, int | float) else 1 for d in shape] if isinstance(shape, list) else old
        detail = f"{name} ne {old} -> {t.ne}"
    elif op == "ndims":
        old = list(t.ne)
        t.ne = rng.choice([[], [1] * 5, [*old, 1], old[:1] if len(old) > 1 else [*old, 2]])
        detail = f"{name} n_dims {len(old)} -> {len(t.ne)} ({t.ne})"
    elif op == "type":
        old_type, t.gtype = t.gtype, rng.choice([x for x in GGML_TYPES if x != t.gtype])
        detail = f"{name} ggml type {old_type} -> {t.gtype}"
    elif op == "offset":
        old_off = t.offset
        t.offset = rng.choice([old_off + g.alignment, old_off - g.alignment, old_off + 1, 2**63, 2**64 - 32, 0])
        t.offset %= 2**64
        detail = f"{name} offset {old_off} -> {t.offset}"
    elif op == "name":
        t.name = rng.choice([g.infos[0].name, t.name + b"x", b"", b"n" * 64, t.name.replace(b"blk.0", b"blk.7")])
        detail = f"{name} renamed {t.name[:40]!r}"
    elif op == "swap":
        same = [o for o in g.infos if o is not t and o.ne == t.ne and o.gtype == t.gtype]
        other = rng.choice(same or g.infos)
        t.offset, other.offset = other.offset, t.offset
        g.infos.sort(key=lambda x: x.offset)
        where = "tensor info swap same-shape offsets" if same else "tensor info swap offsets"
        detail = f"offsets of {name} and {other.name.decode()} swapped"
    else:
        data = bytearray(g.data)
        start = next(s for s, r in regions if r == f"data of {name}") - (len(path.read_bytes()) - len(g.data))
        k = start + rng.randrange(max(1, min(64, len(data) - start)))
        data[k] ^= 1 << rng.randrange(8)
        g.data = bytes(data)
        where, detail = f"tensor data of type {t.gtype}", f"{name}: bit flipped at data byte {k}"
    path.write_bytes(g.serialize())
    return Mutation("gguf-tensor", "model.gguf", where, detail)


# ---------------------------------------------------------------------------------------------- ONNX


def onnx_mutator(ctx: Ctx) -> Mutation:
    """One edit of an ONNX model's protobuf (node, attribute, initializer, external data, opset),
    reserialized; the external data file is left as it is."""
    import onnx
    from fuzz_onnx import edit_model

    rng = ctx.rng
    rel = rng.choice([f for f in files_of(ctx.root) if f.endswith(".onnx")] + ["model.onnx"])
    path = ctx.root / rel
    model = onnx.load_model_from_string(path.read_bytes())
    where, detail = edit_model(model, rng)
    path.write_bytes(model.SerializeToString())
    return Mutation("onnx", rel, f"{rel} {where}", detail)


def interesting_int(rng: random.Random, old: int) -> int:
    value = interesting(rng, old)
    return value if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63 else old + 1
