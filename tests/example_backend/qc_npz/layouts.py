"""``npz-codes`` v1: one code per byte in the logical shape, the IR's logical codes as they are (so
``weights.npz`` shows them), declared under its own name because a published artifact's weights are
always in a target's layout, never in ``logical``: the IR's ``Logical`` layout, registered again."""

from __future__ import annotations

from qcompiler.ir.layouts import Logical


class NpzCodes(Logical, family="npz-codes", version=1):
    pass
