"""The frontend's lowering of ``qcompiler::dequantize_ggml`` (the op ``quant_blocks.py`` defines) to
``q.source_blocks``: registered with the frontend's lowering table when ``quant_blocks`` is imported,
so any graph that holds the op can be lowered."""

from __future__ import annotations

import torch
from torch import fx

from qcompiler.backends.gguf import quant_blocks  # defines qcompiler::dequantize_ggml
from qcompiler.frontend.context import Lowering
from qcompiler.frontend.lowerings import lowers
from qcompiler.frontend.quant_sources import const_of, evaluate, fqn_of, lowered_before
from qcompiler.frontend.skeleton import is_fake
from qcompiler.ir.attrs import AttrValue
from qcompiler.ir.core import Value

del quant_blocks


@lowers(torch.ops.qcompiler.dequantize_ggml.default)
def _ggml_dequant(lx: Lowering, n: fx.Node) -> Value:
    """ggml blocks (K-quants) -> ``q.source_blocks``, the bytes exactly as the source holds them."""
    key, before = lowered_before(lx, n)
    if before is not None:
        return before
    blocks = const_of(lx, n.args[0], n)
    assert blocks is not None
    fqn = fqn_of(lx, n)
    attrs: dict[str, AttrValue] = {
        "source": lx.sources.get(fqn, "qcompiler.dequantize_ggml"),
        "format": str(n.args[1]),
        "blocks": lx.add_tensor(f"{fqn}.blocks", blocks),
    }
    if is_fake(blocks):
        attrs["decode_op"] = "qcompiler::dequantize_ggml"
    else:
        with torch.no_grad():
            attrs["effective"] = lx.add_tensor(f"{fqn}.effective", evaluate(n, lx))
    lx.dequantized[key] = lx.emit("q.source_blocks", [], lx.type_of(n), attrs, name=fqn.replace(".", "_"))
    return lx.dequantized[key]
