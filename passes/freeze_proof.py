"""``freeze-semantics``' proof: a weight's reference decode equals the source's effective weight
bit for bit (its own dequantize of the same codes, or the float weight it recorded)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qcompiler.ir import row_blocks
from qcompiler.ir.reference import decode
from qcompiler.parity_rows import DecodeEvidence
from qcompiler.quant.describe import Described, FreezeError


def source_decode(
    codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, group: int, qmin: int, qmax: int
) -> np.ndarray:
    """``qcompiler::dequantize_affine`` (the source module's own dequantize, ``decode_op``) evaluated
    on the weight's codes and qparams, in float32: the value the reference decode must equal."""
    import torch

    def t(a: np.ndarray) -> torch.Tensor:
        if a.dtype == np.uint16:  # bf16 bits
            return torch.from_numpy(a.astype(np.int16, copy=True)).view(torch.bfloat16)
        return torch.from_numpy(np.array(a, copy=True, order="C"))

    z = None if zero is None else t(zero)
    return torch.ops.qcompiler.dequantize_affine(t(codes), t(scale), z, group, qmin, qmax, torch.float32).numpy()


@dataclass(frozen=True)
class Affine:
    """A source weight's codes and qparams as ``qcompiler::dequantize_affine`` takes them."""

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    group: int
    qmin: int
    qmax: int

    def rows(self, r0: int, r1: int) -> np.ndarray:
        """``source_decode`` of rows ``[r0, r1)`` (qparams of one row are shared by every row)."""
        n = int(self.codes.shape[0])

        def cut(a: np.ndarray) -> np.ndarray:
            return a[r0:r1] if a.ndim >= 1 and int(a.shape[0]) == n else a

        zero = None if self.zero is None else cut(self.zero)
        return source_decode(self.codes[r0:r1], cut(self.scale), zero, self.group, self.qmin, self.qmax)


PROOF_ELEMENTS = 1 << 20
"""Elements proven at a time: the decodes compared stay a few MB (heap-sized) whatever the weight."""


def prove_source_rows(where: str, d: Described, src: Affine, evidence: DecodeEvidence | None = None) -> None:
    """``prove_exact`` against the source's own dequantize, a block of rows at a time when the
    descriptor decodes by rows (``row_blocks``): the same verdict and first differing index as one
    whole-tensor comparison (the count of differing values is the first bad block's). Each block
    of the decode also goes to ``evidence`` (its digest and rung 3, ``qcompiler.proofs``)."""
    t = d.type
    if src.codes.ndim != 2 or tuple(src.codes.shape) != tuple(t.shape) or not row_blocks.sliceable(t):
        decoded = source_decode(src.codes, src.scale, src.zero, src.group, src.qmin, src.qmax)
        prove_exact(where, t, d.arrays, decoded, evidence)
        return
    for r0, r1 in row_blocks.blocks(t, PROOF_ELEMENTS):
        got = row_blocks.decoded_rows(d.arrays, t, r0, r1)
        compare(where, src.rows(r0, r1), got, (r0, r1))
        if evidence is not None:
            evidence.add(r0, r1, got)


def prove_exact(
    where: str, t: object, arrays: dict[str, np.ndarray], effective: np.ndarray, evidence: DecodeEvidence | None = None
) -> None:
    """The reference decode of ``arrays`` equals ``effective`` bit for bit."""
    got = np.asarray(decode(t, arrays), dtype=np.float32)  # type: ignore[arg-type]
    compare(where, effective, got, None)
    if evidence is not None:
        evidence.add(0, int(got.shape[0]) if got.ndim else 0, got)


def compare(where: str, effective: np.ndarray, got: np.ndarray, rows: tuple[int, int] | None) -> None:
    """``got`` (the reference decode, or its rows ``rows``) equals ``effective`` bit for bit."""
    want = effective.astype(np.float32, copy=False)
    if np.array_equal(want.view(np.uint32), got.view(np.uint32)):
        return
    same = want.view(np.uint32) == got.view(np.uint32)
    idx = tuple(int(i) for i in np.argwhere(~same)[0])
    at = list(idx) if rows is None else [idx[0] + rows[0], *idx[1:]]
    block = "" if rows is None else f" in rows [{rows[0]}, {rows[1]})"
    raise FreezeError(
        f"{where}: reference decode differs from the source's effective weight at {at} "
        f"(expected {float(want[idx])!r} from the source, got {float(got[idx])!r}); "
        f"{int((~same).sum())} of {same.size}{block} differ"
    )
