"""The typed quantized IR (QIR): types, ops, module, printer, parser, verifier."""

from qcompiler.ir import ops as _ops  # registers every op
from qcompiler.ir import reference_mixprec as _reference_mixprec  # registers the mixprec decoder
from qcompiler.ir.core import BlobRef, Graph, Module, Op, TensorDecl, Value, create_op
from qcompiler.ir.parser import parse_module, parse_type, split_input
from qcompiler.ir.printer import print_module
from qcompiler.ir.types import DenseType, QuantType
from qcompiler.ir.verifier import verify_module

del _ops, _reference_mixprec

__all__ = [
    "BlobRef",
    "DenseType",
    "Graph",
    "Module",
    "Op",
    "QuantType",
    "TensorDecl",
    "Value",
    "create_op",
    "parse_module",
    "parse_type",
    "print_module",
    "split_input",
    "verify_module",
]
