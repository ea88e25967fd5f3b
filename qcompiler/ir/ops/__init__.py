"""Op definitions. Importing this package registers every op in ``Op.registry``."""

from qcompiler.ir.ops import dense, quant, test

__all__ = ["dense", "quant", "test"]
