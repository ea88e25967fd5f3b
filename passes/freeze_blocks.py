"""``freeze-semantics`` for ``q.source_blocks``: a source's block format (llama.cpp K-quants) becomes a
descriptor with nested qparams, proven to decode to the source's own dequantize bit for bit.

The blocks are split by the format's codec into codes, sub-block scales (and mins) and super-block
``d`` (and ``dmin``); ``describe_blocks`` states them as a ``nested`` descriptor; the reference
decoder must then reproduce ``effective`` exactly. Codes and qparams are stored as tensors
``@w.codes``, ``@w.scale.codes``, ``@w.scale.scale`` ..., bound in the same nested shape.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qcompiler.errors import PassError
from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.blobs import read_array, read_float32, store
from qcompiler.ir.core import Module, Op, create_op
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.ops.shapes import dense
from qcompiler.quant.describe import numpy_dtype_name
from qcompiler.quant.ggml_blocks import Binding, codec_of, describe_blocks
from qcompiler.quant.reference import decode


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


def source_decode(m: Module, op: Op, shape: tuple[object, ...]) -> np.ndarray:
    """The source's own dequantize (``decode_op``) evaluated on the weight's blocks, in float32."""
    import torch

    blocks = op.attrs["blocks"]
    assert isinstance(blocks, SymbolRef)
    data = torch.from_numpy(read_array(m, blocks.name).copy())
    n = int(shape[-1])  # type: ignore[call-overload]
    out = torch.ops.qcompiler.dequantize_ggml(data, str(op.attrs["format"]), n, torch.float32)
    return out.numpy()


def freeze_blocks(m: Module, op: Op, req: str) -> Op:
    blocks_ref, effective_ref = op.attrs["blocks"], op.attrs.get("effective")
    assert isinstance(blocks_ref, SymbolRef)
    name = blocks_ref.name.removesuffix(".blocks")
    fmt = str(op.attrs["format"])
    parts = codec_of(fmt).split(read_array(m, blocks_ref.name))
    t, arrays = describe_blocks(fmt, parts, dense(op.result).dtype)
    t = dataclasses.replace(t, req=req)
    got = np.asarray(decode(t, arrays), dtype=np.float32)
    want = (
        read_float32(m, effective_ref.name)
        if isinstance(effective_ref, SymbolRef)
        else source_decode(m, op, dense(op.result).shape)
    )
    same = got.view(np.uint32) == want.view(np.uint32)
    if not same.all():
        idx = [int(i) for i in np.argwhere(~same)[0]]
        raise PassError(
            f"tensor @{name}: the {fmt} descriptor's reference decode differs from the source's dequantize at {idx} "
            f"(expected {float(want[tuple(idx)])!r}, got {float(got[tuple(idx)])!r})"
        )
    return create_op("q.weight", [], [t], bind(m, name, arrays), [op.result.name])
