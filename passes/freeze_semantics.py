"""``freeze-semantics``: Turn the source's quantization state into immutable descriptors and prove the reference decode
equals the source's effective weights exactly; record provenance. Never requantizes.

Registered now so pipelines can name it and be validated; its work lands with its own issue. Until
then the pass manager refuses any pipeline that contains it, before running anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qcompiler.passes.base import UnimplementedPass


@dataclass(frozen=True)
class FreezeSemanticsPass(UnimplementedPass):
    """Freeze quantization state into immutable descriptors (not implemented yet)."""

    name: ClassVar[str] = "freeze-semantics"
    requires: ClassVar[frozenset[str]] = frozenset()
    establishes: ClassVar[frozenset[str]] = frozenset({"semantics-frozen"})
