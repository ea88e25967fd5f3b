"""``freeze-semantics`` for ``q.source_blocks``: a source's block format (llama.cpp K-quants) becomes a
descriptor with nested qparams, proven to decode to the source's own dequantize bit for bit.

The blocks are split by the format's codec into codes, sub-block scales (and mins) and super-block
``d`` (and ``dmin``); ``describe_blocks`` states them as a ``nested`` descriptor; the reference
decoder must then reproduce ``effective`` exactly. Codes and qparams are stored as tensors
``@w.codes``, ``@w.scale.codes``, ``@w.scale.scale`` ..., bound in the same nested shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from qcompiler.backends.gguf.quant_blocks import Binding, codec_of, describe_blocks
from qcompiler.errors import PassError
from qcompiler.ir import row_blocks
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import as_float32, read_array, store
from qcompiler.ir.core import Module, Op, create_op, narrow
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.ops.quant_blocks import SourceBlocks
from qcompiler.ir.ops.shapes import dense
from qcompiler.ir.reference import decode
from qcompiler.ir.types import QuantType
from qcompiler.quant.describe import numpy_dtype_name


def bind(m: Module, prefix: str, arrays: Binding) -> dict[str, AttrValue]:
    out: dict[str, AttrValue] = {}
    for part, arr in arrays.items():
        key = f"{prefix}.{part}"
        if isinstance(arr, dict):
            out[part] = bind(m, key, arr)  # pyright: ignore[reportUnknownArgumentType]
            continue
        store(m, key, arr, DTYPES[numpy_dtype_name(arr)])
        out[part] = SymbolRef(key)
    return out


def source_decode(data: np.ndarray, fmt: str, n: int) -> np.ndarray:
    """The source's own dequantize (``decode_op``) evaluated on block rows ``data``, in float32."""
    import torch

    blocks = torch.from_numpy(np.ascontiguousarray(data).copy())
    return torch.ops.qcompiler.dequantize_ggml(blocks, fmt, n, torch.float32).numpy()


def effective_rows(m: Module, name: str) -> Callable[[int, int], np.ndarray]:
    """Rows of a stored effective weight as float32 (bf16 bits widened exactly), a block at a time."""
    arr, dtype = read_array(m, name), m.tensors[name].blob.dtype.name
    return lambda r0, r1: as_float32(arr[r0:r1], dtype)


@dataclasses.dataclass(frozen=True)
class ProvenBlocks:
    """One ``q.source_blocks`` weight described and proven (``prove_blocks``), not bound yet."""

    name: str
    type: QuantType
    arrays: Binding


def freeze_blocks(m: Module, op: Op, req: str) -> Op:
    """``bind_blocks`` of ``prove_blocks``: the weight's ``q.weight``, its parts stored in ``m``."""
    return bind_blocks(m, op, prove_blocks(m, op, req))


def bind_blocks(m: Module, op: Op, proven: ProvenBlocks) -> Op:
    """The proven weight's ``q.weight``, its codes and nested qparams stored as tensors of ``m``."""
    return create_op("q.weight", [], [proven.type], bind(m, proven.name, proven.arrays), [op.result.name])


def prove_blocks(m: Module, op: Op, req: str) -> ProvenBlocks:
    """Describe one ``q.source_blocks`` weight and prove its reference decode equals the source's
    dequantize, a block of rows at a time for a huge weight (``row_blocks``): the proof's memory is
    the weight's parts and one block of float32, not two whole float32 decodes. Reads ``m``, changes
    nothing (safe in threads)."""
    src = narrow(op, SourceBlocks)
    blocks_ref, effective_ref = src.blocks, src.effective
    name = blocks_ref.name.removesuffix(".blocks")
    fmt = src.format
    data = read_array(m, blocks_ref.name)
    t, arrays = describe_blocks(fmt, codec_of(fmt).split(data), dense(op.result).dtype)
    t = dataclasses.replace(t, req=req)
    n = int(dense(op.result).shape[-1])

    def decoded_source(r0: int, r1: int) -> np.ndarray:
        return source_decode(data[r0:r1], fmt, n)

    want = effective_rows(m, effective_ref.name) if effective_ref is not None else decoded_source
    rows = int(t.shape[0])
    for r0, r1 in row_blocks.blocks(t) if row_blocks.huge(t) else [(0, rows)]:
        whole = (r0, r1) == (0, rows)
        st = t if whole else row_blocks.slice_type(t, r0, r1)
        got = np.asarray(decode(st, arrays if whole else row_blocks.slice_parts(t, arrays, r0, r1)), dtype=np.float32)
        expected = want(r0, r1)
        same = got.view(np.uint32) == expected.view(np.uint32)
        if not same.all():
            idx = [int(i) for i in np.argwhere(~same)[0]]
            raise PassError(
                f"tensor @{name}: the {fmt} descriptor's reference decode differs from the source's dequantize at "
                f"{[idx[0] + r0, *idx[1:]]} (expected {float(expected[tuple(idx)])!r}, got {float(got[tuple(idx)])!r})"
            )
    return ProvenBlocks(name, t, arrays)
