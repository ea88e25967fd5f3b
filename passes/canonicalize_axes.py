"""``canonicalize-axes``: One orientation ``[N, K]`` (out x in), groups along K, the tail-group rule and any act-order
permutation explicit (with its inverse), transposes folded. Proves decode is unchanged.

Registered now so pipelines can name it and be validated; its work lands with its own issue. Until
then the pass manager refuses any pipeline that contains it, before running anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qcompiler.passes.base import UnimplementedPass


@dataclass(frozen=True)
class CanonicalizeAxesPass(UnimplementedPass):
    """Bring quantized weights to [N, K] with groups along K (not implemented yet)."""

    name: ClassVar[str] = "canonicalize-axes"
    requires: ClassVar[frozenset[str]] = frozenset({"semantics-frozen"})
    establishes: ClassVar[frozenset[str]] = frozenset({"axes-canonical"})
