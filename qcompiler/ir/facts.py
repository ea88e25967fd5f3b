"""The model facts a graph encodes, derived from a module's ops and constants alone, and the record
of the values a graph cannot show.

A GGUF's metadata and a transformers ``config.json`` restate what the graph computes (hidden size,
head counts, epsilon, rope base ...). A reader derives the facts here from the reopened
``graph.qir`` and checks each restated value against them, so a value edited in a container is
refused by what it means, not by a hash. Nothing here knows a container: each backend holds its own
table of key -> fact -> comparison.

| fact | derived from |
|---|---|
| ``vocab``, ``hidden`` | the token embedding (of the graph's first argument): table ``[vocab, hidden]`` |
| ``layers`` | the number of ``sdpa`` ops |
| ``heads``, ``head_dim`` | every sdpa's query ``[batch, heads, seq, head_dim]`` |
| ``kv_heads`` | the key projection (the one linear, or slice of one, behind sdpa's key): width / ``head_dim`` |
| ``ff``, ``act`` | the first activation of a linear (``silu``, ``gelu``, ``gelu_tanh``, ``relu``), its width |
| ``norm``, ``eps`` | ``rms``: ``add(mean(pow(x, 2)), full)`` or ``rms_norm``; ``layer``: ``layer_norm`` |
| ``inv_freq``, ``rotary_dim`` | the 1-D constant the angles are multiplied by before ``cos``; the cos's width |
| ``tied`` | the output head reads the token embedding's table (the same value, tensor or codes) |
| ``causal`` | every sdpa's ``causal`` |
| ``positions`` | rows of an embedding indexed by ``0..n-1`` (a learned position table) |
| ``token_types`` | rows of the other embedding beside tokens and positions (BERT's token types) |

Every occurrence must agree (all norms one epsilon, all sdpa ops one head count), else the fact is
``None``.

The rms-norm epsilon of a llama graph, for example::

    %pow_1 = pow(%embedding, %c_2) : tensor<f32[?batch,?seq,64]>
    %mean = mean(%pow_1) {axes = [-1], keepdim = true} : tensor<f32[?batch,?seq,1]>
    %c_3 = full() {value = 1e-06, shape = []} : tensor<f32[]>
    %add_141 = add(%mean, %c_3) : tensor<f32[?batch,?seq,1]>        # -> norm "rms", eps 1e-06

A fact the graph does not show is ``None`` (a llama graph has no position table, so its context length
is no graph fact). Those values are bound instead by the writer's *record*: the module attribute
``bound = {SECTION = [[NAME, SHA256], ...]}``, one sha256 of the canonical JSON of each value
(``digest``), written by ``with_record`` into the ``graph.qir`` the artifact ships and checked by
``check_recorded`` against what the reader finds, naming the key that differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from qcompiler.errors import FileError
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import read_array, read_float32
from qcompiler.ir.core import Graph, Module, Op, Value
from qcompiler.ir.ops.attention import Sdpa
from qcompiler.ir.ops.dense import Binary, Cast, Embedding, Linear, Return, Unary
from qcompiler.ir.ops.quant import QEmbedding, QLinear
from qcompiler.ir.ops.tensor import Mean

LINEARS = ("linear", "q.linear")
ACTIVATIONS = ("silu", "gelu", "relu")
PASS_THROUGH = ("reshape", "expand", "transpose", "cast", "slice", "gather", "add", "mul", "neg", "concat", "rotary")
"""Ops walked through when tracing a value back to its projection or index source."""
ROPE_ULPS = 2
"""How far (ulps of the table's dtype) an inv_freq recomputed from a rope base may lie from the graph's."""
FLOAT_TABLES = ("f32", "bf16", "f16")
BOUND = "bound"


@dataclass(frozen=True)
class ModelFacts:
    """What the graph computes, fact by fact (``None``: the graph does not show it)."""

    vocab: int | None = None
    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    ff: int | None = None
    act: str | None = None
    norm: str | None = None
    eps: float | None = None
    rotary_dim: int | None = None
    inv_freq: tuple[float, ...] | None = None
    inv_freq_dtype: str = "f32"
    tied: bool | None = None
    causal: bool | None = None
    positions: int | None = None
    token_types: int | None = None

    @property
    def rope_base(self) -> float | None:
        """The rope base the inv_freq table implies (an estimate, for messages: compare with ``rope_matches``)."""
        if self.inv_freq is None or self.rotary_dim is None or len(self.inv_freq) < 2 or self.inv_freq[1] <= 0:
            return None
        return float(self.inv_freq[1] ** (-self.rotary_dim / 2))


def rope_matches(facts: ModelFacts, base: float, factors: np.ndarray | None = None) -> bool:
    """Whether ``inv_freq[i] = 1 / base ** (2i / rotary_dim) / factors[i]`` (transformers' default rope,
    exponents in float32; ``factors``: llama.cpp's ``rope_freqs``, else 1) reproduces the graph's table
    to ``ROPE_ULPS`` ulps of its dtype (a bf16 table is bf16); a 1-entry table holds 1.0 for any base."""
    kind = facts.inv_freq_dtype
    if facts.inv_freq is None or facts.rotary_dim is None or kind not in FLOAT_TABLES or not math.isfinite(base):
        return False
    d = facts.rotary_dim
    exps = (np.arange(0, d, 2).astype(np.float32) / np.float32(d)).astype(np.float64)
    have = np.asarray(facts.inv_freq, dtype=np.float32)
    if base <= 0 or (factors is not None and factors.shape != have.shape) or exps.shape != have.shape:
        return False
    want = (1.0 / np.float64(base) ** exps / (1.0 if factors is None else factors)).astype(np.float32)
    ulp = np.spacing(np.abs(want.astype(np.float16) if kind == "f16" else want)).astype(np.float64)
    ulp *= 2**16 if kind == "bf16" else 1  # bf16: float32's exponent, 16 fewer mantissa bits
    return bool(np.all(np.abs(want.astype(np.float64) - have.astype(np.float64)) <= ROPE_ULPS * ulp))


# ---------------------------------------------------------------------------------------------- derivation


def dims(v: Value) -> tuple[int | None, ...]:
    """``v``'s dims, a dynamic one as ``None``."""
    return tuple(d if isinstance(d, int) else None for d in getattr(v.type, "shape", ()))


def last_dim(v: Value) -> int | None:
    shape = dims(v)
    return shape[-1] if shape else None


def table_identity(v: Value) -> str:
    """What an embedding or head reads: the tensor a ``const`` names, a ``q.weight``'s codes, else the value."""
    op = v.producer
    if op is not None and op.name == "const":
        return f"tensor {op.attrs.get('ref')}"
    if op is not None and op.name == "q.weight":
        return f"codes {op.attrs.get('codes')}"
    return f"value {id(v)}"


def one(values: list[object]) -> object | None:
    """The single value every occurrence agrees on, else ``None``."""
    return values[0] if values and all(v == values[0] for v in values) else None


def sources(v: Value, stop: tuple[str, ...], *, fused: bool = False) -> Iterator[Op]:
    """The ops in ``stop`` reached back from ``v`` through ``PASS_THROUGH`` ops (not through a stop op);
    ``fused``: a ``slice`` of a stop op's result in its place (Phi-3's k is a slice of ``qkv_proj``)."""
    seen: set[int] = set()
    todo = [v]
    while todo:
        op = todo.pop().producer
        if op is None or id(op) in seen:
            continue
        seen.add(id(op))
        into = op.operands[0].producer if fused and op.name == "slice" else None
        if op.name in stop or (into is not None and into.name in stop):
            yield op
        elif op.name in PASS_THROUGH:
            todo.extend(op.operands)


def root_of(v: Value) -> Op | None:
    """The op a value's first-operand chain starts from (through ``PASS_THROUGH`` ops)."""
    op = v.producer
    while op is not None and op.name in PASS_THROUGH and op.operands:
        op = op.operands[0].producer  # the first operand of whichever pass-through op this is
    return op


def rms_eps(op: Op) -> float | None:
    """``eps`` of ``add(mean(pow(x, 2)), full{value = eps})`` (either operand order), else ``None``."""
    if op.name != "add" or len(op.operands) != 2:
        return None
    for a, b in (op.operands, op.operands[::-1]):
        mean, full = a.producer, b.producer
        if not isinstance(mean, Mean) or full is None or full.name != "full":
            continue
        sq = mean.x.producer
        two = sq.rhs.producer if isinstance(sq, Binary) and sq.name == "pow" else None
        squared = two is not None and two.name == "full" and two.attrs.get("value") == 2.0
        if squared or (isinstance(sq, Binary) and sq.name == "mul" and sq.lhs is sq.rhs):
            value = full.attrs.get("value")
            return float(value) if isinstance(value, int | float) else None
    return None


def norms(g: Graph) -> list[tuple[str, float]]:
    """(kind, epsilon) of every norm of ``g``."""
    out: list[tuple[str, float]] = []
    for op in g.ops:
        eps = op.attrs.get("eps")
        if op.name in ("layer_norm", "rms_norm") and isinstance(eps, int | float):
            out.append(("layer" if op.name == "layer_norm" else "rms", float(eps)))
        elif (found := rms_eps(op)) is not None:
            out.append(("rms", found))
    return out


def activation(op: Op) -> str:
    """The activation's name as the fact table spells it."""
    if op.name == "gelu":
        return "gelu_tanh" if op.attrs.get("approximate") == "tanh" else "gelu"
    return op.name


def rope(m: Module, g: Graph) -> tuple[int | None, tuple[float, ...] | None, str]:
    """(rotary width, inv_freq values, their dtype): the 1-D float constant (perhaps through a ``cast``)
    the angles are multiplied by before the graph takes their ``cos``."""
    widths: list[object] = []
    tables: list[object] = []
    for op in g.ops:
        if not isinstance(op, Unary) or op.name != "cos":
            continue
        widths.append(last_dim(op.result))
        for mul in sources(op.x, ("mul",)):
            for x in mul.operands:
                c = x.producer
                while isinstance(c, Cast) and c.operands:
                    c = c.x.producer
                ref = c.attrs.get("ref") if c is not None and c.name == "const" else None
                if isinstance(ref, SymbolRef) and ref.name in m.tensors and len(m.tensors[ref.name].blob.shape) == 1:
                    values = tuple(float(f) for f in read_float32(m, ref.name))
                    tables.append((values, m.tensors[ref.name].blob.dtype.name))
    width, table = one(widths), one(tables)
    values, dtype = table if isinstance(table, tuple) else (None, "f32")
    return (width if isinstance(width, int) else None), values, dtype  # pyright: ignore[reportReturnType]


def is_positions(m: Module, op: Op | None, rows: int) -> bool:
    """Whether an index source is ``0..n-1``: an ``arange`` from 0, or an integer constant holding it."""
    if op is None:
        return False
    if op.name == "arange":
        return op.attrs.get("start") == 0 and op.attrs.get("step") == 1
    ref = op.attrs.get("ref") if op.name == "const" else None
    if not isinstance(ref, SymbolRef) or ref.name not in m.tensors:
        return False
    values = read_array(m, ref.name).reshape(-1)
    return values.dtype.kind in "iu" and 2 <= values.size <= rows and np.array_equal(values, np.arange(values.size))


def embeddings(m: Module, g: Graph) -> dict[str, tuple[int, int, str]]:
    """Role (``tokens``, ``positions``, ``types``) -> (rows, columns, table identity)."""
    out: dict[str, tuple[int, int, str]] = {}
    first = g.args[0] if g.args else None
    for op in g.ops:
        if not isinstance(op, Embedding | QEmbedding) or len(op.operands) < 2:
            continue
        table, ids = op.w, op.ids
        shape = dims(table)
        rows, cols = shape if len(shape) == 2 else (None, None)
        if rows is None or cols is None:
            continue
        if ids is first:
            role = "tokens"
        elif is_positions(m, root_of(ids), rows):
            role = "positions"
        else:
            role = "types"
        out.setdefault(role, (rows, cols, table_identity(table)))
    return out


def attention(g: Graph) -> dict[str, object]:
    """Layers, heads, head dim, KV heads and causality, from the ``sdpa`` ops."""
    ops = [op for op in g.ops if isinstance(op, Sdpa)]
    queries = [dims(op.q) for op in ops]
    heads = one([q[1] if len(q) == 4 else None for q in queries])
    head_dim = one([q[3] if len(q) == 4 else None for q in queries])
    kv: list[object] = []
    for op in ops:
        projections = list(sources(op.k, LINEARS, fused=True))
        width = last_dim(projections[0].result) if len(projections) == 1 else None
        if isinstance(width, int) and isinstance(head_dim, int) and head_dim > 0 and width % head_dim == 0:
            kv.append(width // head_dim)
        else:
            kv.append(None)
    causal = one([op.attrs.get("causal") for op in ops])
    return {
        "layers": len(ops) or None,
        "heads": heads,
        "head_dim": head_dim,
        "kv_heads": one(kv),
        "causal": causal if isinstance(causal, bool) else None,
    }


def head_tied(g: Graph, tokens: str | None) -> bool | None:
    """Whether the linear the graph returns reads the token table; ``None`` without such a head."""
    ret = g.ops[-1] if g.ops else None
    heads = list(sources(ret.values[0], LINEARS)) if isinstance(ret, Return) and ret.values else []
    if len(heads) != 1 or tokens is None or not isinstance(head := heads[0], Linear | QLinear):
        return None  # sources() stops only at LINEARS: heads[0] is a Linear or QLinear
    return table_identity(head.w) == tokens


def model_facts(m: Module, graph: str = "forward") -> ModelFacts:
    """Every fact of the table above that ``m``'s graph ``graph`` (else its first) shows."""
    g = m.graph(graph) or (m.graphs[0] if m.graphs else None)
    if g is None:
        return ModelFacts()
    emb = embeddings(m, g)
    tokens = emb.get("tokens")
    acts = [op for op in g.ops if isinstance(op, Unary) and op.name in ACTIVATIONS and any(sources(op.x, LINEARS))]
    found = norms(g)
    kinds, eps = one([k for k, _ in found]), one([e for _, e in found])
    width, inv_freq, inv_freq_dtype = rope(m, g)
    att = attention(g)

    def num(key: str) -> int | None:
        v = att[key]
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    return ModelFacts(
        vocab=tokens[0] if tokens else None,
        hidden=tokens[1] if tokens else None,
        layers=num("layers"),
        heads=num("heads"),
        kv_heads=num("kv_heads"),
        head_dim=num("head_dim"),
        ff=last_dim(acts[0].result) if acts else None,
        act=activation(acts[0]) if acts else None,
        norm=kinds if isinstance(kinds, str) else None,
        eps=eps if isinstance(eps, float) else None,
        rotary_dim=width,
        inv_freq=inv_freq,
        inv_freq_dtype=inv_freq_dtype,
        tied=head_tied(g, tokens[2] if tokens else None),
        causal=att["causal"] if isinstance(att["causal"], bool) else None,
        positions=emb["positions"][0] if "positions" in emb else None,
        token_types=emb["types"][0] if "types" in emb else None,
    )


# ---------------------------------------------------------------------------------------------- the record


def digest(value: object) -> str:
    """sha256 of ``value``'s canonical JSON (sorted keys, no spaces; floats as ``repr``, so exact)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def with_record(m: Module, sections: Mapping[str, Mapping[str, str]]) -> Module:
    """A shallow copy of ``m`` whose ``bound`` attribute records ``sections`` (name -> {NAME: sha256}),
    replacing any record it carried."""
    record: dict[str, AttrValue] = {
        section: [[name, sha] for name, sha in sorted(values.items())] for section, values in sections.items()
    }
    return dataclasses.replace(m, attrs={**m.attrs, BOUND: record})


def recorded(m: Module, section: str) -> dict[str, str] | None:
    """The record's ``section`` as {NAME: sha256}, or ``None`` when it is absent or malformed."""
    record = m.attrs.get(BOUND)
    rows = record.get(section) if isinstance(record, dict) else None
    if not isinstance(rows, list):
        return None
    out: dict[str, str] = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == 2 and all(isinstance(x, str) for x in row)):
            return None
        name, sha = row
        if name in out:
            return None
        out[str(name)] = str(sha)
    return out


def check_recorded(m: Module, section: str, found: Mapping[str, str], *, file: str = "", noun: str = "key") -> None:
    """``found`` ({NAME: sha256} of what a file holds) must be exactly the record's ``section``: a
    ``FileError`` names ``file`` and the key (or, without ``file``, the file NAME) added, missing or changed."""

    def fail(message: str, name: str, expected: object, got: object) -> FileError:
        return FileError(message, file=file or name, field=name if file else "sha256", expected=expected, found=got)

    want = recorded(m, section)
    if want is None:
        raise FileError(
            "graph.qir records no binding for it (an edited graph, or a writer before bindings)",
            file=file or "graph.qir",
            field=f"bound.{section}",
            expected=f"[[{noun}, sha256], ...]",
            found="none",
        )
    for name in sorted(set(found) - set(want)):
        raise fail(
            f"{noun} {name!r} is in {file or 'the artifact'} but nothing binds it", name, "no such " + noun, "one"
        )
    for name in sorted(set(want) - set(found)):
        raise fail(f"{noun} bound by graph.qir is missing", name, "present", "none")
    for name in sorted(want):
        if want[name] != found[name]:
            raise fail(
                f"{noun} differs from what the writer wrote (graph.qir binds its sha256)", name, want[name], found[name]
            )
