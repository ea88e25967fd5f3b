"""``q.source_mixprec``: one ``mixed-2416`` weight as its source module holds it, before
``freeze-semantics`` states it as a ``mixprec`` descriptor (``qcompiler/ir/mixprec.py``).

``%w = q.source_mixprec() {source = "qcompiler.quantize(mixed-2416)", group = 64, group2 = 64,
codes = @w.codes, zero = @w.zero, scale_codes = @w.scale.codes, scale2 = @w.scale.scale,
zero2 = @w.scale.zero, wide = @w.wide, wide_rows = @w.wide_rows, rowptr = @w.rowptr, col = @w.col, value = @w.value,
effective = @w.effective} : tensor<f32[64,256]>``

``effective`` is the source's own dequantize (``qcompiler::dequantize_mixprec``), which the frozen
descriptor must reproduce bit for bit.
"""

from __future__ import annotations

from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.core import Module, Op, attr
from qcompiler.ir.ops.quant import check_ref, static_dims
from qcompiler.ir.ops.shapes import dense, fail

STREAMS = ("codes", "zero", "scale_codes", "scale2", "zero2", "wide", "wide_rows", "rowptr", "col", "value")


class SourceMixprec(Op, name="q.source_mixprec"):
    """A ``mixed-2416`` weight's streams as its source holds them (see the module docstring)."""

    source = attr(str)
    group = attr(int)
    group2 = attr(int)
    codes = attr(SymbolRef)
    zero = attr(SymbolRef)
    scale_codes = attr(SymbolRef)
    scale2 = attr(SymbolRef)
    zero2 = attr(SymbolRef)
    wide = attr(SymbolRef)
    wide_rows = attr(SymbolRef)
    rowptr = attr(SymbolRef)
    col = attr(SymbolRef)
    value = attr(SymbolRef)
    effective = attr(SymbolRef)

    def verify_(self, module: Module) -> None:
        t = dense(self.result)
        shape = static_dims(self, t, "result type", "a source weight")
        if len(shape) != 2:
            raise fail(self, "result type", "a mixprec weight is rank 2 [N, K]", "rank 2", t.short())
        check_ref(self, module, self.effective, t.dtype.name, shape, "effective")
        check_ref(self, module, self.codes, "u8", shape, "codes")
        for name in STREAMS:
            ref = self.attrs[name]
            if not isinstance(ref, SymbolRef) or ref.name not in module.tensors:
                raise fail(self, name, "unknown tensor", "a tensor-table entry", ref)
