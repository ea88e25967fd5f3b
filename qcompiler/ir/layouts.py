"""Physical layouts of codes, registered by ``(family, version)``.

Each layout states the exact shape and dtype it gives the codes blob (so the verifier can check the
tensor table against the descriptor) and has a packer and an unpacker; ``pack-layouts`` proves
``unpack(pack(Q)) == Q`` for every tensor it packs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from qcompiler import plugins
from qcompiler.errors import QcError
from qcompiler.ir.dtypes import DType
from qcompiler.ir.types import PackSpec, QuantType


class LayoutError(QcError):
    """Codes that a layout cannot pack, or a blob it cannot unpack (names the part, expected, found)."""

    def __init__(self, part: str, message: str, expected: object = "", found: object = "") -> None:
        self.part, self.message = part, message
        super().__init__(f"{part}: {message} (expected {expected}, found {found})")


class Layout:
    """A code layout. Subclass with ``class X(Layout, family="x", version=1)``."""

    family: ClassVar[str] = ""
    version: ClassVar[int] = 0
    encodings: ClassVar[tuple[str, ...]] = ("none",)
    fields_in_range: ClassVar[bool] = False
    """Every bit pattern of the blob unpacks to a value of the code dtype's range (codes are fixed-width
    bit fields, as in ``ct-pack-quantized``): codes whose alphabet is that whole range need no check."""
    registry: ClassVar[dict[tuple[str, int], type[Layout]]] = {}
    needs: ClassVar[tuple[str, ...]] = ()
    """Slots of the weight its packer and unpacker read besides the codes (``mixprec``'s precision
    map); such a layout's ``pack``/``unpack`` take them as a third argument (``pack_codes``)."""

    def __init_subclass__(cls, family: str = "", version: int = 0, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if not family:
            return
        key = (family, version)
        if key in Layout.registry:
            raise TypeError(f"layout {family} v{version} registered twice")
        cls.family, cls.version = family, version
        Layout.registry[key] = cls

    @classmethod
    def physical(cls, t: QuantType) -> tuple[DType, tuple[int, ...]]:
        """dtype and shape of the codes blob for a tensor of type ``t`` (static shape)."""
        raise TypeError(f"layout {cls.family} v{cls.version} does not define its physical shape")

    @classmethod
    def row_axis(cls, t: QuantType) -> int | None:
        """The axis of the codes blob that logical row ``r`` (axis 0) of a 2-D weight lies along, one
        index per row, with nothing of other rows mixed in; ``None`` when rows do not slice apart."""
        return None

    @classmethod
    def pack(cls, codes: np.ndarray, t: QuantType) -> np.ndarray:
        """Logical codes (one per element, logical shape) -> the physical codes blob."""
        raise TypeError(f"layout {cls.family} v{cls.version} has no packer")

    @classmethod
    def unpack(cls, blob: np.ndarray, t: QuantType) -> np.ndarray:
        """The physical codes blob -> logical codes; ``unpack(pack(Q)) == Q`` must hold."""
        raise TypeError(f"layout {cls.family} v{cls.version} has no unpacker")


class Logical(Layout, family="logical", version=1):
    """One code per byte (``i8`` for signed codes, ``u8`` for unsigned), logical shape, row-major."""

    @classmethod
    def row_axis(cls, t: QuantType) -> int | None:
        return 0

    @classmethod
    def physical(cls, t: QuantType) -> tuple[DType, tuple[int, ...]]:
        return t.code.dtype.container, tuple(int(d) for d in t.shape)

    @classmethod
    def pack(cls, codes: np.ndarray, t: QuantType) -> np.ndarray:
        return np.ascontiguousarray(codes, dtype=np.dtype(t.code.dtype.container.numpy)).copy()

    @classmethod
    def unpack(cls, blob: np.ndarray, t: QuantType) -> np.ndarray:
        return np.ascontiguousarray(blob, dtype=np.dtype(t.code.dtype.container.numpy)).copy()


def find_layout(family: str, version: int) -> type[Layout] | None:
    """The layout registered as ``(family, version)``: ``logical`` is the IR's own; every other one
    is defined by the backend that declares it (``LAYOUTS``, ``qcompiler.plugins``), imported on
    first use; ``None`` when nobody declares it."""
    key = (family, version)
    if key not in Layout.registry:
        provider = plugins.declared("LAYOUTS").get(key)
        if provider is not None:
            plugins.provide(provider)
    return Layout.registry.get(key)


def all_layouts() -> dict[tuple[str, int], type[Layout]]:
    """Every layout: the IR's own and every one a backend declares, each imported."""
    for family, version in plugins.declared("LAYOUTS"):
        find_layout(family, version)
    return dict(Layout.registry)


def pack_codes(layout: type[Layout], codes: np.ndarray, t: QuantType, slots: Mapping[str, Any] | None) -> np.ndarray:
    """``layout.pack``, given the slots it ``needs`` when it needs any."""
    if not layout.needs:
        return layout.pack(codes, t)
    return layout.pack(codes, t, needed(layout, slots))  # pyright: ignore[reportCallIssue]


def unpack_codes(layout: type[Layout], blob: np.ndarray, t: QuantType, slots: Mapping[str, Any] | None) -> np.ndarray:
    """``layout.unpack``, given the slots it ``needs`` when it needs any."""
    if not layout.needs:
        return layout.unpack(blob, t)
    return layout.unpack(blob, t, needed(layout, slots))  # pyright: ignore[reportCallIssue]


def needed(layout: type[Layout], slots: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    missing = [n for n in layout.needs if slots is None or not isinstance(slots.get(n), np.ndarray)]
    if missing:
        raise LayoutError(missing[0], f"layout {layout.family} v{layout.version} needs this slot", "an array", "none")
    assert slots is not None
    return {n: slots[n] for n in layout.needs}


def logical_view(
    blob: np.ndarray, t: QuantType, slots: Mapping[str, Any] | None = None
) -> tuple[np.ndarray, QuantType]:
    """The codes of a ``t``-typed weight unpacked to the logical layout, and ``t`` with that layout
    (what the reference decoders read), whatever layout ``blob`` is in; ``slots`` are the weight's
    other arrays, for a layout that ``needs`` some."""
    layout = find_layout(t.pack.family, t.pack.version)
    if layout is None:
        raise TypeError(f"unknown layout {t.pack.family} v{t.pack.version}")
    return unpack_codes(layout, blob, t, slots), dataclasses.replace(t, pack=PackSpec())
