"""``q.source_blocks``: a weight held in a block format of its source (llama.cpp's K-quants), exactly as
stored, before ``freeze-semantics`` turns it into a descriptor.

``%w = q.source_blocks() {source = "qcompiler.dequantize_ggml", format = "Q4_K", blocks = @w.blocks,
effective = @w.effective} : tensor<f32[64,256]>``

``blocks`` is ``u8[N, row_bytes]`` (one row of blocks per output row); ``effective`` the float
weight the source's own dequantize produced, which the frozen descriptor must reproduce bit for bit.
"""

from __future__ import annotations

from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.core import Module, Op, attr, optional_attr
from qcompiler.ir.ops.quant import check_ref, static_dims
from qcompiler.ir.ops.shapes import dense, fail


class SourceBlocks(Op, name="q.source_blocks"):
    """A weight in a source's block format (see the module docstring)."""

    source = attr(str)
    format = attr(str)
    blocks = attr(SymbolRef)
    effective = optional_attr(SymbolRef)
    decode_op = optional_attr(str, choices=("qcompiler::dequantize_ggml",))

    def verify_(self, module: Module) -> None:
        t = dense(self.result)
        shape = static_dims(self, t, "result type", "a source weight")
        if len(shape) != 2:
            raise fail(self, "result type", "a block-format weight is rank 2 [N, K]", "rank 2", t.short())
        effective = self.effective
        if (effective is None) == (self.decode_op is None):
            raise fail(self, "effective", "exactly one of effective and decode_op", "one", "both or neither")
        if effective is not None:
            check_ref(self, module, effective, t.dtype.name, shape, "effective")
        blocks = self.blocks
        decl = module.tensors.get(blocks.name)
        if decl is None:
            raise fail(self, "blocks", "unknown tensor", "a tensor-table entry", blocks)
        if decl.blob.dtype.name != "u8" or len(decl.blob.shape) != 2 or decl.blob.shape[0] != shape[0]:
            raise fail(
                self, "blocks", "blocks must be u8 rows, one per output row", f"u8[{shape[0]},?]", decl.type_str()
            )
