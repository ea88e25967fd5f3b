"""The reference decoder of ``mixprec`` (``qcompiler.ir.mixprec``): the second level, then the first,
then the outliers.

``scale`` arrives decoded already (a quantized qparam is decoded by its own family's decoder first:
``s1 = float32(q_s - z2) * float32(s2)``); each group is ``float32(code - zero) * float32(s1)``, the
affine v1 formula; then ``w[r, col[i]] = float32(value[i])`` for the outliers of row ``r``
(``rowptr[r] <= i < rowptr[r + 1]``). The cross-stream rules (``mixprec.data_problem``) are checked
first: a decode never reads a map, a code or an outlier those rules refuse.
"""

from __future__ import annotations

import numpy as np

from qcompiler.ir.mixprec import data_problem
from qcompiler.ir.reference import Bound, DecodeError, F32Array, _affine_grouped, decoder  # pyright: ignore[reportPrivateUsage]
from qcompiler.ir.types import QuantType


@decoder("mixprec", 1)
def _mixprec_v1(t: QuantType, b: Bound) -> F32Array:
    arrays = {name: b.slots[name] for name in ("wide", "wide_rows", "col", "rowptr", "zero")}
    problem = data_problem(t, b.codes, arrays)
    if problem is not None:
        raise DecodeError(problem.field, problem.message, problem.expected, problem.found)
    out = _affine_grouped(t, b).copy()
    rowptr = b.slots["rowptr"].astype(np.int64)
    rows = np.repeat(np.arange(out.shape[0]), np.diff(rowptr))
    out[rows, b.slots["col"].astype(np.int64)] = b.slots["value"].astype(np.float32)
    return out
