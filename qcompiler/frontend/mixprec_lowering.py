"""The frontend's lowering of ``qcompiler::dequantize_mixprec`` (``quant/mixprec_module.py``) to
``q.source_mixprec``: every stream copied as it is, and the op evaluated on them for ``effective``."""

from __future__ import annotations

import torch
from torch import fx

from qcompiler.frontend.context import Lowering, UnsupportedError, where_from
from qcompiler.frontend.lowerings import lowers
from qcompiler.frontend.quant_sources import const_of, evaluate, fqn_of, lowered_before
from qcompiler.frontend.skeleton import is_fake
from qcompiler.ir.attrs import AttrValue
from qcompiler.ir.core import Value
from qcompiler.quant import mixprec_module

TENSOR_NAMES = {"scale_codes": "scale.codes", "scale2": "scale.scale", "zero2": "scale.zero"}
"""Streams whose tensor is named as the nested binding names it (``@w.scale.codes``)."""


@lowers(torch.ops.qcompiler.dequantize_mixprec.default)
def _mixprec_dequant(lx: Lowering, n: fx.Node) -> Value:
    key, before = lowered_before(lx, n)
    if before is not None:
        return before
    fqn = fqn_of(lx, n)
    attrs: dict[str, AttrValue] = {"source": lx.sources.get(fqn, "qcompiler.dequantize_mixprec")}
    for i, name in enumerate(mixprec_module.STREAMS):
        arr = const_of(lx, n.args[i], n)
        assert arr is not None
        if is_fake(arr):
            raise UnsupportedError(
                f"{n.target}: a mixed-2416 weight is quantized in memory, not streamed: {where_from(n)}"
            )
        attrs[name] = lx.add_tensor(f"{fqn}.{TENSOR_NAMES.get(name, name)}", arr)
    count = len(mixprec_module.STREAMS)
    attrs["group"], attrs["group2"] = int(n.args[count]), int(n.args[count + 1])  # type: ignore[arg-type]
    with torch.no_grad():
        attrs["effective"] = lx.add_tensor(f"{fqn}.effective", evaluate(n, lx))
    lx.dequantized[key] = lx.emit("q.source_mixprec", [], lx.type_of(n), attrs, name=fqn.replace(".", "_"))
    return lx.dequantized[key]
