"""Per-weight facts proven while a compile runs, kept by content, so that the parity evidence on
the reopened artifact does not prove them a second time.

``freeze-semantics`` proves each weight's reference decode equal to the source's, a block of rows
at a time; with the decode at hand it also records the decode's digest (``decode_digest``) and
rung 3's operator errors (``DecodeFact``) under the weight's ``Key``: its name, its descriptor as printed, and the
sha256 of every tensor bound to it. ``pack-layouts`` proves ``unpack(pack(Q)) == Q`` and records
the packed weight's key as another name for the logical one (``alias``).

The ladder on the reopened artifact (``qcompiler.ladder``) looks every weight's key up. The
production reader checked the sha256 of every tensor it bound, so a weight with the same name,
descriptor and tensor hashes is the same bytes read by the same deterministic decoder: its rung 1
is the packing proof, its decode digest and rung 3 the recorded ones. A weight whose key is not found
(another descriptor, other bytes, a fact nobody recorded) is proven again from its bytes.
``qcompiler verify`` has no facts and proves everything.

The stream can do the two passes' work ahead, while it holds a weight (``passes/ahead.py``): it
records what ``freeze-semantics`` would make of a weight (``Frozen``, keyed by the pass's inputs:
``freeze_known.frozen_key``) and what ``pack-layouts`` would pack it into; each pass takes such a
fact only for exactly the inputs it was proven from.

    proofs.record(key_of(m, name, op, t), DecodeFact(digest, {"rel_kernel": ...}))
    proofs.alias(packed_key, logical_key)  # after unpack(pack(Q)) == Q
    proofs.lookup(key)  # -> (fact, packing proven) or None
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.core import BlobRef, Module, Op
from qcompiler.ir.types import QuantType


@dataclass(frozen=True)
class Key:
    """A weight as content: name (rung 3's input and float weight are the name's), descriptor as
    printed, and ``(slot, sha256)`` of every tensor bound to it."""

    name: str
    type: str
    tensors: tuple[tuple[str, str], ...]


def key_of(m: Module, name: str, op: Op, t: QuantType) -> Key | None:
    """``name``'s key in ``m`` (``op`` its ``q.weight``), or ``None`` when a bound tensor is not
    in the tensor table."""
    tensors: list[tuple[str, str]] = []

    def walk(binding: Mapping[str, AttrValue], at: str) -> bool:
        for slot, v in sorted(binding.items()):
            if isinstance(v, dict):
                if not walk(v, f"{at}{slot}."):
                    return False
            elif isinstance(v, SymbolRef):
                decl = m.tensors.get(v.name)
                if decl is None:
                    return False
                tensors.append((at + slot, decl.blob.sha256))
        return True

    return Key(name, str(t), tuple(tensors)) if walk(op.attrs, "") else None


def refs_key(name: str, t: QuantType, refs: Mapping[str, BlobRef]) -> Key:
    """The key ``key_of`` gives a weight whose flat binding is ``refs`` (slot -> reference), before
    it is bound into a module."""
    return Key(name, str(t), tuple(sorted((slot, r.sha256) for slot, r in refs.items())))


@dataclass(frozen=True)
class DecodeFact:
    """What was proven about one weight's reference decode."""

    digest: str
    """The decode's digest (``decode_digest.DECODE_DIGEST``: float32, little-endian, row-major)."""
    rung3: dict[str, float] | None = None
    """Rung 3's metrics (``parity.metrics_of``) for a linear's weight; ``None`` otherwise."""


@dataclass(frozen=True)
class Frozen:
    """A source weight frozen ahead (``passes/ahead.py``): its descriptor, the reference of each
    array bound to it, and the facts of its decode."""

    type: QuantType
    parts: dict[str, BlobRef]
    fact: DecodeFact


@dataclass
class Proofs:
    """The facts of one compile (thread-safe; see the module docstring)."""

    decodes: dict[Key, DecodeFact] = field(default_factory=dict[Key, DecodeFact])
    packed: dict[Key, Key] = field(default_factory=dict[Key, Key])
    """Packed key -> the logical key it unpacks to (``unpack(pack(Q)) == Q`` proven)."""
    frozen_ahead: dict[Hashable, Frozen] = field(default_factory=dict[Hashable, Frozen])
    """``freeze-semantics``' inputs for one weight (``freeze_known.frozen_key``) -> what it would make of them."""
    packed_ahead: dict[Hashable, tuple[BlobRef, QuantType]] = field(
        default_factory=dict[Hashable, tuple[BlobRef, QuantType]]
    )
    """``pack-layouts``' inputs for one weight (``packed_key``) -> its packed codes and descriptor."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def freeze(self, key: Hashable, frozen: Frozen) -> None:
        with self.lock:
            self.frozen_ahead[key] = frozen

    def frozen(self, key: Hashable) -> Frozen | None:
        with self.lock:
            return self.frozen_ahead.get(key)

    def pack(self, key: Hashable, packed: tuple[BlobRef, QuantType]) -> None:
        with self.lock:
            self.packed_ahead[key] = packed

    def packed_as(self, key: Hashable) -> tuple[BlobRef, QuantType] | None:
        with self.lock:
            return self.packed_ahead.get(key)

    def record(self, key: Key | None, fact: DecodeFact) -> None:
        if key is None:
            return
        with self.lock:
            self.decodes[key] = fact

    def alias(self, packed: Key | None, logical: Key | None) -> None:
        if packed is None or logical is None:
            return
        with self.lock:
            self.packed[packed] = logical

    def lookup(self, key: Key | None) -> tuple[DecodeFact, bool] | None:
        """The fact recorded for ``key`` and whether its packing was proven (``alias``); ``None``
        when nothing was recorded for it."""
        if key is None:
            return None
        with self.lock:
            logical = self.packed.get(key)
            fact = self.decodes.get(key if logical is None else logical)
        return None if fact is None else (fact, logical is not None)


def packed_key(logical: Key | None, pack: object) -> tuple[Key | None, str]:
    """What ``pack-layouts`` packs one weight from: its logical key and the target's pack spec."""
    return logical, str(pack)
