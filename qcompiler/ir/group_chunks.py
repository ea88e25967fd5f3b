"""Vectorised grouping for the reference decoders: rows of a tensor in chunks, each with the function
that repeats a per-group qparam over the chunk's span of the group axis."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

Array: TypeAlias = npt.NDArray[Any]

AFFINE_CHUNK = 1 << 22
"""Elements decoded at a time (the decoders' float64 temporaries stay ~32 MB)."""


def group_chunks(
    axis: int, size: int, shape: tuple[int, ...], qparam: Array
) -> Iterator[tuple[tuple[slice, ...], Callable[[Array], Array]]]:
    """Chunks of rows of a tensor of ``shape`` grouped by ``size`` along ``axis``, each with a function
    that repeats a qparam's groups over the chunk (a short last group keeps its real length): the
    vectorised form of a loop over groups, with temporaries of about ``AFFINE_CHUNK`` elements."""
    of = np.arange(shape[axis]) // size
    outer = next((d for d in range(len(shape)) if d != axis and qparam.shape[d] == shape[d]), None)
    if outer is None:
        spans = [slice(None)]
    else:
        step = max(1, AFFINE_CHUNK * shape[outer] // max(1, int(np.prod(shape))))
        spans = [slice(i, i + step) for i in range(0, shape[outer], step)]
    whole = tuple(slice(0, shape[axis]) if d == axis else slice(None) for d in range(len(shape)))

    def expand(q: Array, idx: tuple[slice, ...]) -> Array:
        if q.shape[axis] * size < shape[axis]:
            return np.take(q[idx], of, axis=axis)  # too few groups: take's IndexError names it
        return np.repeat(q[idx], size, axis=axis)[whole]  # = take(of): each group ``size`` times, cut to length

    for span in spans:
        idx = tuple(span if d == outer else slice(None) for d in range(len(shape)))
        yield idx, lambda q, idx=idx: expand(q, idx)


SMALL_INTS = frozenset(np.dtype(d).name for d in (np.int8, np.uint8, np.int16, np.uint16))
"""Code and zero dtypes whose values and differences are exact in float32 (|x| < 2**24)."""


def affine_whole_groups(codes: Array, scale: Array, zero: Array | None, axis: int, size: int) -> Array | None:
    """The affine decode ``float32(code - zero[g]) * float32(scale[g])`` when groups of ``size``
    tile the last axis exactly and codes (and zero points) are small integers: the codes widened
    to float32 in place of the output, ``zero`` subtracted and ``scale`` multiplied per group by
    broadcasting (the same exact difference and one float32 multiply per element, as the chunked
    loop computes); ``None`` when the shapes or dtypes do not allow it."""
    shape = codes.shape
    if not shape or axis != len(shape) - 1 or shape[-1] % size or codes.dtype.name not in SMALL_INTS:
        return None
    grouped = (*shape[:-1], shape[-1] // size)
    if scale.shape != grouped or (zero is not None and (zero.shape != grouped or zero.dtype.name not in SMALL_INTS)):
        return None
    out = codes.astype(np.float32).reshape(*grouped, size)
    if zero is not None:
        np.subtract(out, zero.astype(np.float32)[..., None], out=out)
    np.multiply(out, scale.astype(np.float32)[..., None], out=out)
    return out.reshape(shape)
