"""Weight quantization: schemes, round-to-nearest affine quantization and the reference decoders.

``parse_scheme("w4-g128-asym")`` gives a ``Scheme``; ``quantize_weight(w, scheme)`` an
``AffineQuant`` whose ``dequantize()`` follows the affine decode contract; ``reference.decode``
is the slow numpy oracle for every family (affine, nested, ternary, mixed).
"""

from qcompiler.quant.reference import DECODERS, DecodeError, decode, decoder
from qcompiler.quant.rtn import AffineQuant, QuantizeError, quantize_weight
from qcompiler.quant.schemes import Scheme, SchemeError, parse_scheme

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
