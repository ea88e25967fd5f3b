"""Op definitions. Importing this package registers every op in ``Op.registry``."""

from qcompiler.ir.ops import attention, dense, quant, quant_blocks, quant_mixprec, tensor, test

__all__ = ["attention", "dense", "quant", "quant_blocks", "quant_mixprec", "tensor", "test"]
