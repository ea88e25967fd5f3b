"""Quantized weights as ONNX initializers and nodes, per form, and where ``graph.qir`` finds each IR tensor.

| IR tensor | ``qdq`` | ``nbits`` |
|---|---|---|
| codes (``onnx-kn`` ``i8 [K, N]``) | ``W.qweight`` int4/int8 ``[K, N]`` (view ``nibbles``) | |
| codes (``ort-nbits`` ``u8 [N, K*b/8]``) | | ``W.B`` uint8 ``[N, K/B, B*b/8]``, same bytes |
| scale ``f32 [N, K/G]`` | ``W.scale`` ``[K/B, N]`` (``T,every``) | ``W.scales`` ``[N, K/B]`` (``every``) |
| zero ``i8 [N, K/G]`` | ``W.zero`` int4/int8 ``[K/B, N]`` | ``W.zero_points`` uint8, ``z + 2^(b-1)`` packed |
| perm ``i32 [K]`` (act order) | ``W.perm``, same dtype and bytes | ``W.perm``, same dtype and bytes |

An act-order weight (stored column ``j`` is original column ``perm[j]``) keeps its grouped codes; its
``q.linear`` reads the input gathered, ``Gather(x, W.perm, axis=-1)``, since
``x @ W^T = x[..., perm] @ W_stored^T``. Only ``q.linear`` reads such a weight (``plan.py``).

A quantized table (``logical`` ``[V, D]``) is ``W.qtable`` int4/int8 behind
``DequantizeLinear(axis=1) -> Gather`` in both forms.

``B`` is the block (``plan.block_size`` of the group size ``G``); a qparam is repeated ``G / B`` times
along its blocks, which the view ``every=G/B`` undoes. Dense tensors keep their name and bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from qcompiler.backends.onnx.builder import LowerError, OnnxBuilder, tensor_of
from qcompiler.backends.onnx.layouts import NBITS, pack_fields
from qcompiler.backends.onnx.plan import block_size, group_of
from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.blobs import read_array
from qcompiler.ir.core import Op
from qcompiler.ir.types import QuantType

MODEL_FILE = "model.onnx"
NO_CACHE_FILE = "model_no_cache.onnx"
"""A causal LM's graph without the KV cache (``--onnx-no-cache-graph``); it shares ``model.onnx.data``."""
INT_TYPES = {(4, True): TensorProto.INT4, (8, True): TensorProto.INT8}


def pack_nibbles(codes: np.ndarray) -> bytes:
    """int4 values, flattened row-major, two per byte, the first in the low nibble (ONNX's int4 packing)."""
    flat = np.ascontiguousarray(codes, dtype=np.int8).reshape(-1).view(np.uint8) & 0xF
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).tobytes()


def int_tensor(name: str, values: np.ndarray, bits: int) -> TensorProto:
    if bits == 4:
        return helper.make_tensor(name, TensorProto.INT4, list(values.shape), pack_nibbles(values), raw=True)
    return numpy_helper.from_array(np.ascontiguousarray(values, dtype=np.int8), name)


@dataclass
class QWeight:
    """One ``q.weight``: its name, descriptor and IR tensors."""

    name: str
    t: QuantType
    codes: str
    scale: str
    zero: str | None
    perm: str | None = None

    @property
    def bits(self) -> int:
        return self.t.code.dtype.bits

    @property
    def block(self) -> int:
        block = block_size(group_of(self.t))
        if block == 0:
            raise LowerError(f"{self.name}: group size {group_of(self.t)} has no power-of-two block >= 16")
        return block

    @property
    def repeat(self) -> int:
        return group_of(self.t) // self.block


@dataclass
class WeightForm:
    """Lowers ``q.weight``/``q.linear``/``q.embedding``/``q.dequantize`` for one form, and records
    ``graph.qir`` locations (IR tensor name -> ``onnx:`` location)."""

    form: str
    accuracy_level: int
    locations: dict[str, str] = field(default_factory=dict[str, str])
    weights: dict[str, QWeight] = field(default_factory=dict[str, QWeight])
    emitted: dict[str, str] = field(default_factory=dict[str, str])

    def lowering(self, op_name: str) -> Callable[[OnnxBuilder, Op, list[str]], str] | None:
        table: dict[str, Callable[[OnnxBuilder, Op, list[str]], str]] = {
            "q.weight": self.weight,
            "q.linear": self.linear,
            "q.embedding": self.embedding,
            "q.dequantize": self.dequantize,
        }
        return table.get(op_name)

    def at(self, tensor: str, initializer: str, view: str = "") -> None:
        self.locations[tensor] = f"onnx:{MODEL_FILE}#{initializer}" + (f"@{view}" if view else "")

    def dense_initializer(self, b: OnnxBuilder, tensor: str) -> str:
        if tensor not in self.emitted:
            b.taken.add(tensor)
            dtype = b.m.tensors[tensor].blob.dtype.name
            b.initializers.append(tensor_of(np.asarray(read_array(b.m, tensor)), tensor, dtype))
            self.emitted[tensor] = tensor
            self.at(tensor, tensor)
        return self.emitted[tensor]

    def weight(self, b: OnnxBuilder, op: Op, xs: list[str]) -> str:
        t = op.result.type
        assert isinstance(t, QuantType)
        refs = {k: v.name for k, v in op.attrs.items() if isinstance(v, SymbolRef)}
        name = refs["codes"].removesuffix(".codes")
        self.weights[op.result.name] = QWeight(
            name, t, refs["codes"], refs["scale"], refs.get("zero"), refs.get("perm") if t.perm else None
        )
        return b.fresh(f"{op.result.name}_ref")

    def of(self, op: Op, i: int) -> QWeight:
        w = self.weights.get(op.operands[i].name)
        if w is None:
            raise LowerError(f"{op.describe()}: operand {i} is not a q.weight")
        if w.t.perm is not None and (op.name != "q.linear" or w.perm is None):
            raise LowerError(f"{op.describe()}: an act-order permutation is only lowered for q.linear (its input)")
        return w

    def permuted_input(self, b: OnnxBuilder, w: QWeight, x: str, hint: str) -> str:
        """``x`` as the stored columns read it: ``Gather(x, perm, axis=-1)`` for an act-order weight
        (the permutation an initializer of its own dtype and bytes), ``x`` itself otherwise."""
        if w.perm is None:
            return x
        if w.perm not in self.emitted:
            b.taken.add(w.perm)
            b.initializers.append(numpy_helper.from_array(np.asarray(read_array(b.m, w.perm)), w.perm))
            self.at(w.perm, w.perm)
            self.emitted[w.perm] = w.perm
        return b.node("Gather", [x, self.emitted[w.perm]], f"{hint}_x", axis=-1)

    def qparams(self, b: OnnxBuilder, w: QWeight, transpose: bool) -> tuple[str, str | None]:
        """The scale (and zero) initializers, repeated per block, ``[blocks, N]`` when ``transpose``."""
        if w.name in self.emitted:
            return self.emitted[w.name], self.emitted.get(f"{w.name}#zero")
        scale = np.repeat(read_array(b.m, w.scale).astype(np.float32), w.repeat, axis=1)
        view = ",".join(v for v in ("T" if transpose else "", f"every={w.repeat}") if v)
        s_name = f"{w.name}.scale" if self.form == "qdq" or w.t.req == "embedding" else f"{w.name}.scales"
        b.taken.add(s_name)
        b.initializers.append(numpy_helper.from_array(np.ascontiguousarray(scale.T if transpose else scale), s_name))
        self.at(w.scale, s_name, view)
        self.emitted[w.name] = s_name
        if w.zero is None:
            return s_name, None
        zero = np.repeat(read_array(b.m, w.zero).astype(np.int16), w.repeat, axis=1)
        z_name = f"{w.name}.zero"
        b.taken.add(z_name)
        b.initializers.append(int_tensor(z_name, np.ascontiguousarray(zero.T if transpose else zero), w.bits))
        self.at(w.zero, z_name, ",".join(v for v in ("nibbles" if w.bits == 4 else "", view) if v))
        self.emitted[f"{w.name}#zero"] = z_name
        return s_name, z_name

    def dq(self, b: OnnxBuilder, w: QWeight, hint: str) -> str:
        """``DequantizeLinear`` of a weight as stored (``[K, N]`` on axis 0, or a table ``[V, D]`` on axis 1)."""
        table = w.t.pack.family == "logical"
        q_name = f"{w.name}.{'qtable' if table else 'qweight'}"
        if q_name not in self.emitted:
            b.taken.add(q_name)
            b.initializers.append(int_tensor(q_name, read_array(b.m, w.codes), w.bits))
            self.at(w.codes, q_name, "nibbles" if w.bits == 4 else "")
            self.emitted[q_name] = q_name
        scale, zero = self.qparams(b, w, transpose=not table)
        inputs = [q_name, scale] + ([zero] if zero else [])
        return b.node("DequantizeLinear", inputs, hint, axis=1 if table else 0, block_size=w.block)

    def linear(self, b: OnnxBuilder, op: Op, xs: list[str]) -> str:
        w = self.of(op, 1)
        n = op.result.name
        xs = [self.permuted_input(b, w, xs[0], n), *xs[1:]]
        if self.form == "nbits":
            return self.matmul_nbits(b, w, op, xs)
        mm = b.node("MatMul", [xs[0], self.dq(b, w, f"{n}_w")], n if len(xs) == 2 else f"{n}_mm")
        return mm if len(xs) == 2 else b.node("Add", [mm, xs[2]], n)

    def matmul_nbits(self, b: OnnxBuilder, w: QWeight, op: Op, xs: list[str]) -> str:
        n_rows, k = (int(d) for d in w.t.shape)
        bits = NBITS[w.t.pack.encoding]
        k_blocks = k // w.block
        b_name = f"{w.name}.B"
        if b_name not in self.emitted:
            packed = np.asarray(read_array(b.m, w.codes), dtype=np.uint8).reshape(n_rows, k_blocks, -1)
            b.taken.add(b_name)
            b.initializers.append(numpy_helper.from_array(np.ascontiguousarray(packed), b_name))
            self.at(w.codes, b_name)
            self.emitted[b_name] = b_name
        scale, _ = self.qparams_nbits(b, w, bits, k_blocks)
        zp = self.emitted.get(f"{w.name}#zp", "")
        inputs = [xs[0], b_name, scale, zp, "", xs[2] if len(xs) > 2 else ""]
        while inputs and not inputs[-1]:
            inputs.pop()
        return b.node(
            "MatMulNBits",
            inputs,
            op.result.name,
            domain="com.microsoft",
            K=k,
            N=n_rows,
            bits=bits,
            block_size=w.block,
            accuracy_level=self.accuracy_level,
        )

    def qparams_nbits(self, b: OnnxBuilder, w: QWeight, bits: int, k_blocks: int) -> tuple[str, str | None]:
        if w.name in self.emitted:
            return self.emitted[w.name], self.emitted.get(f"{w.name}#zp")
        scale = np.repeat(read_array(b.m, w.scale).astype(np.float32), w.repeat, axis=1)
        s_name = f"{w.name}.scales"
        b.taken.add(s_name)
        b.initializers.append(numpy_helper.from_array(np.ascontiguousarray(scale), s_name))
        self.at(w.scale, s_name, f"every={w.repeat}")
        self.emitted[w.name] = s_name
        if w.zero is None:
            return s_name, None
        offset = 1 << (bits - 1)
        zero = np.repeat(read_array(b.m, w.zero).astype(np.int16), w.repeat, axis=1) + offset
        if zero.min() < 0 or zero.max() >= (1 << bits):
            raise LowerError(f"{w.name}: zero point outside the {bits}-bit code range")
        per = 8 // bits
        padded = np.zeros((zero.shape[0], -(-k_blocks // per) * per), np.uint8)
        padded[:, :k_blocks] = zero
        z_name = f"{w.name}.zero_points"
        b.taken.add(z_name)
        b.initializers.append(numpy_helper.from_array(pack_fields(padded, bits), z_name))
        self.at(w.zero, z_name, f"fields={bits}:{k_blocks},sub={offset},every={w.repeat}")
        self.emitted[f"{w.name}#zp"] = z_name
        return s_name, z_name

    def embedding(self, b: OnnxBuilder, op: Op, xs: list[str]) -> str:
        w = self.of(op, 0)
        return b.node("Gather", [self.dq(b, w, f"{op.result.name}_table"), xs[1]], op.result.name, axis=0)

    def dequantize(self, b: OnnxBuilder, op: Op, xs: list[str]) -> str:
        w = self.of(op, 0)
        if w.t.pack.family == "logical":
            return self.dq(b, w, op.result.name)
        if w.t.pack.family == "onnx-kn":
            return b.node("Transpose", [self.dq(b, w, f"{op.result.name}_kn")], op.result.name, perm=[1, 0])
        raise LowerError(f"{op.describe()}: a MatMulNBits weight is only read by q.linear")
