"""Ops for IR tests only.

``test.producer`` yields values of any types from nothing, so a test of a quantized type or a pass
does not need unrelated ops to make its inputs (like xDSL's ``test.op``)::

    %a, %b = test.producer() : tensor<f32[4,8]>, !q.affine<...>
"""

from __future__ import annotations

from typing import ClassVar

from qcompiler.ir.core import Op, TypeKind


class Producer(Op, name="test.producer"):
    """Produces any number of values of any types; accepts any attributes."""

    result_kinds: ClassVar[tuple[TypeKind, ...]] = ()
    variadic_results = True
    open_attrs = True
