"""Op definitions. Importing this package registers every op in ``Op.registry``."""

from qcompiler.ir.ops import dense, quant, tensor, test

__all__ = ["dense", "quant", "tensor", "test"]
