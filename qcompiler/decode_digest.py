"""The digest of a weight's reference decode, recorded at compile time so that ``qcompiler verify``
re-proves rung 2 (reconstruction) from the artifact alone.

The decode is the weight's float32 values, little-endian, row-major: at 1.1B parameters 4.4 GB of
bytes to hash per compile (and per verify), so the digest is BLAKE3 (7.5 GB/s on one core here,
against 2.0 GB/s for sha256). Artifacts of schema 1 recorded sha256; their decodes are hashed with
it again when they are verified. The table is keyed by the manifest field that holds the digests
(``parity.rung2_reconstruction.<field>``).

    h = DIGESTS[DECODE_DIGEST]()
    h.update(memoryview(decoded_rows).cast("B")); h.hexdigest()
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

import blake3


class Hasher(Protocol):
    def update(self, data: memoryview | bytes, /) -> object: ...

    def hexdigest(self) -> str: ...


DIGESTS: dict[str, Callable[[], Hasher]] = {
    "decode_blake3": lambda: blake3.blake3(),
    "decode_sha256": lambda: hashlib.sha256(),
}
"""Manifest field -> a new hasher of that digest."""

DECODE_DIGEST = "decode_blake3"
"""The digest compiles record (artifact schema 2)."""
