"""The parity ladder of one huge weight, a block of rows at a time (``ir.row_blocks``).

Rungs 1-3 and the decode's digest are the whole-weight ladder's, computed block by block: rung 1
unpacks and re-packs each block of stored codes, the decode hash is updated with each block of
float32 rows (the same digest as the whole decode's, rows being contiguous), rung 2 compares each
block with the same rows of the reference, and rung 3 computes each block's columns of the
operator outputs, so the norms are those of the whole outputs. Memory follows the block and the
stored codes, not the decoded weight (a 128256 x 4096 head is 2.1 GB of float32 decoded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from qcompiler.decode_digest import DECODE_DIGEST, DIGESTS
from qcompiler.ir import row_blocks
from qcompiler.ir.core import Module, Op
from qcompiler.ir.types import QuantType
from qcompiler.parity import (
    RungResult,
    finite,
    first_difference,
    max_abs,
    metrics_of,
    norms,
    pack_round_trip,
    parts,
    product,
)

RowReader = Callable[[int, int], "torch.Tensor | np.ndarray"]
"""``(r0, r1) -> rows [r0, r1)`` of a reference weight."""


@runtime_checkable
class RowSource(Protocol):
    """A mapping of weights that reads rows of one without reading it whole."""

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor | np.ndarray: ...


def row_reader(source: Mapping[str, Any] | None, name: str) -> RowReader | None:
    """Rows of ``source[name]``: through ``source.rows(name, r0, r1)`` when the mapping reads rows
    itself (a shard, an emitted module), else sliced from the whole value; ``None`` when absent."""
    if source is None or name not in source:
        return None
    if isinstance(source, RowSource):
        reader = source
        return lambda r0, r1: reader.rows(name, r0, r1)
    whole: torch.Tensor | np.ndarray = source[name]
    return lambda r0, r1: whole[r0:r1]


def float32_rows(value: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().float().contiguous().numpy()
    return np.ascontiguousarray(value, dtype=np.float32)


@dataclasses.dataclass
class Outputs:
    """Rung 3's outputs of one weight, filled a row block's columns at a time: reference decode,
    kernel, float weights (float64, ``rows x out_features``). They are allocated once, before the
    blocks: per-block output pieces kept until the end were each carved from a hole a block's
    temporaries had just left in the heap, so the next block's temporaries no longer fit there and
    the heap grew by about a block per block (a 128256-row head: 4 GB)."""

    x64: torch.Tensor
    """Rung 3's input, widened to float64."""
    ref: torch.Tensor
    kernel: torch.Tensor
    fp: torch.Tensor | None

    @classmethod
    def of(cls, x: torch.Tensor, n: int, floats: bool) -> Outputs:
        def new() -> torch.Tensor:
            return torch.empty(int(x.shape[0]), n, dtype=torch.float64)

        return cls(x.double(), new(), new(), new() if floats else None)


LADDER_BLOCK = 1 << 20
"""Elements of a weight checked at a time (4 MB of float32 decode): every block's temporaries,
float64 products included, are served and reused from the heap (``qcompiler/heap.py``)."""


class DecodeEvidence:
    """The decode's digest (``decode_digest``) and rung 3's outputs of one weight, fed its decoded
    rows a block at a time in row order (``add``), by the ladder and by ``freeze-semantics``' proof,
    which both hold the decode: the same digest and the same operator errors whoever computes them.

    ``x`` is rung 3's input (``parity.rung3_input``; ``None``: not a linear's weight), ``floats``
    the weight's float rows for the quantization error (``None``: not known) and ``digest`` the
    manifest field whose digest is computed (``decode_digest.DIGESTS``)."""

    def __init__(self, x: torch.Tensor | None, n: int, floats: RowReader | None, digest: str = DECODE_DIGEST) -> None:
        self.hasher = DIGESTS[digest]()
        self.floats = floats if x is not None else None
        self.scan = x is not None and not bool((finite("input", x) != 0).all())
        self.out = Outputs.of(x, n, self.floats is not None) if x is not None else None

    def add(self, r0: int, r1: int, got: np.ndarray) -> None:
        """Rows ``[r0, r1)`` of the float32 decode."""
        self.hasher.update(memoryview(np.ascontiguousarray(got, "<f4")).cast("B"))  # pyright: ignore[reportArgumentType]
        if self.out is not None:
            block_outputs(self.out, r0, r1, got, None if self.floats is None else self.floats(r0, r1), self.scan)

    def digest(self) -> str:
        return self.hasher.hexdigest()

    def rung3(self) -> dict[str, float] | None:
        """Rung 3's metrics once every row was added (``None`` for a weight that is not a linear's)."""
        if self.out is None:
            return None
        return metrics_of(norms(self.out.ref, self.out.kernel, self.out.fp))


def check_rows(
    m: Module,
    op: Op,
    t: QuantType,
    name: str,
    x: torch.Tensor | None,
    effective: Mapping[str, Any] | None,
    floats: Mapping[str, Any] | None,
    same_bytes: bool,
    digest: str = DECODE_DIGEST,
) -> tuple[bool, str, list[RungResult], list[RungResult]]:
    """Rung 1's verdict, the decode's ``digest``, rung 2's and rung 3's rows for one weight of more
    than ``LADDER_BLOCK`` elements."""
    bound = parts(m, op.attrs)
    codes = bound["codes"]
    assert isinstance(codes, np.ndarray)
    want = None if same_bytes else row_reader(effective, name)
    ev = DecodeEvidence(x, int(t.shape[0]), row_reader(floats, name), digest)
    ok, diff, worst = True, "", 0.0
    for r0, r1 in row_blocks.blocks(t, LADDER_BLOCK):
        st = row_blocks.slice_type(t, r0, r1)
        good, logical = pack_round_trip(row_blocks.slice_codes(codes, t, r0, r1), st)
        ok = ok and good
        got = row_blocks.decoded_rows(bound, t, r0, r1, logical)
        del logical
        if want is not None:
            ref = float32_rows(want(r0, r1))
            if not (ref.shape == got.shape and np.array_equal(ref.view(np.uint32), got.view(np.uint32))):
                diff = diff or first_difference(ref, got, r0)
                worst = max(worst, max_abs(ref, got))
        ev.add(r0, r1, got)
    r2: list[RungResult] = []
    if same_bytes:
        r2.append(RungResult(2, name, True, "", {"max_abs_diff": 0.0}))
    elif effective is not None:
        r2.append(
            RungResult(2, name, False, "no pre-export weight given for this tensor")
            if want is None
            else RungResult(2, name, not diff, diff, {"max_abs_diff": worst})
        )
    metrics = ev.rung3()
    r3 = [] if metrics is None else [RungResult(3, name, True, "", metrics)]
    return ok, ev.digest(), r2, r3


def block_outputs(out: Outputs, r0: int, r1: int, got: np.ndarray, wf: Any, scan: bool) -> None:
    """Fill columns ``[r0, r1)`` of rung 3's outputs from one row block (``scan``: check the
    weights finite elementwise, an input being zero somewhere)."""
    wq = torch.from_numpy(np.ascontiguousarray(got, dtype=np.float32))
    if scan:
        finite("decoded weight", wq)
    out.ref[:, r0:r1] = product(out.x64, wq, "decoded weight", scan)
    out.kernel[:, r0:r1] = finite("kernel output", torch.nn.functional.linear(out.x64.float(), wq)).double()
    if out.fp is not None and wf is not None:
        w = wf if isinstance(wf, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(wf))
        if scan:
            finite("float weight", w)
        out.fp[:, r0:r1] = product(out.x64, w, "float weight", scan)
