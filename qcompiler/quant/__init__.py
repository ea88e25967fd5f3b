"""Weight quantization: schemes and round-to-nearest affine quantization.

``parse_scheme("w4-g128-asym")`` gives a ``Scheme``; ``quantize_weight(w, scheme)`` an
``AffineQuant`` whose ``dequantize()`` follows the affine decode contract. The reference decoders
(``decode``, the slow numpy oracle for every family) are the IR's semantics and live in
``qcompiler.ir.reference``; they are re-exported here. The torch-based names
(``AffineQuant``, ``quantize_weight``, ``QuantizeError``) load torch on first use, so passes that
only decode stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qcompiler.ir.reference import DECODERS, DecodeError, decode, decoder
from qcompiler.quant.schemes import Scheme, SchemeError, parse_scheme

if TYPE_CHECKING:
    from qcompiler.quant.rtn import AffineQuant, QuantizeError, quantize_weight

_TORCH_NAMES = ("AffineQuant", "QuantizeError", "quantize_weight")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from qcompiler.quant import rtn

        return getattr(rtn, name)
    raise AttributeError(f"module 'qcompiler.quant' has no attribute {name!r}")


__all__ = [
    "DECODERS",
    "AffineQuant",
    "DecodeError",
    "QuantizeError",
    "Scheme",
    "SchemeError",
    "decode",
    "decoder",
    "parse_scheme",
    "quantize_weight",
]
