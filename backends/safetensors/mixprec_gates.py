"""The reader gates of a ``mixprec`` weight (``mixprec_schema.py``); each failure names file, tensor and field.

``qparams`` (before ``graph.qir`` is read), from the container, ``weight_shape`` and the config's
group size alone: every tensor of the table is present once (a quantized scale's three tensors or a
dense ``weight_scale``), each has an accepted dtype and the shape the table gives; the planes are
exactly ``pad16(N*K/4) + pad16(W*G/4)`` bytes (``W``: the 4-bit groups, ``weight_wide``'s length
plus ``K/G`` per row of ``weight_wide_rows``) and every pad byte is zero; the precision map is
canonical (``ir.mixprec.map_problem``: both lists strictly increasing in range, no group of a listed
row in ``weight_wide``, no whole row spelled out there); ``weight_rowptr`` runs
from 0 to the outlier count without decreasing; outlier values and scales are finite.

``graph`` (``check_descriptors``): each mixprec descriptor of ``graph.qir`` is a Linear the config's
``targets`` names, with the config's group size, and each of its slots is located at the table's
container tensor. ``graph.qir`` then verifies with data (``qcompiler.ir.data_checks``): each header
entry's dtype and shape are the descriptor's, the sha256 of every tensor, and ``mixprec.data_problem``
on the unpacked planes (a reordered group or a code wider than its group is refused by name).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from qcompiler.artifact.reader import ArtifactError
from qcompiler.backends.safetensors.container import SafetensorsFile
from qcompiler.backends.safetensors.mixprec_schema import SUFFIX, TABLE, MixScheme, mixprec_weights
from qcompiler.ir.core import Module
from qcompiler.ir.mixprec import map_problem, pad

Where = dict[str, tuple[str, SafetensorsFile]]
NESTED = ("weight_scale_codes", "weight_scale2", "weight_zero2")


def suffixes(where: Where, module: str) -> tuple[str, ...]:
    """The tensors one mixprec Linear stores: a dense ``weight_scale`` or the three of a quantized one."""
    dense = f"{module}.weight_scale" in where
    return tuple(s for s in TABLE if (s == "weight_scale") == dense and (s not in NESTED or not dense))


class Tensors:
    """One module's container tensors, each checked against the table as it is read."""

    def __init__(self, where: Where, module: str) -> None:
        self.where, self.module = where, module

    def fail(self, suffix: str, message: str, field: str, expected: object, found: object) -> ArtifactError:
        name = f"{self.module}.{suffix}"
        return ArtifactError(
            message, file=self.where[name][0], tensor=name, field=field, expected=expected, found=found
        )

    def get(self, suffix: str, shape: Callable[[tuple[int, ...]], bool], want: object) -> np.ndarray:
        name = f"{self.module}.{suffix}"
        f = self.where[name][1]
        e = f.tensors[name]
        if e.dtype not in TABLE[suffix][1]:
            raise self.fail(suffix, "wrong dtype", "dtype", " | ".join(TABLE[suffix][1]), e.dtype)
        if not shape(e.shape):
            raise self.fail(suffix, "wrong shape for the mixprec schema", "shape", want, list(e.shape))
        return np.asarray(f.array(name))

    def exact(self, suffix: str, want: tuple[int, ...]) -> np.ndarray:
        return self.get(suffix, lambda s: s == want, list(want))

    def finite(self, suffix: str, values: np.ndarray) -> None:
        raw = self.where[f"{self.module}.{suffix}"][1].tensors[f"{self.module}.{suffix}"].dtype
        as_float = (values.astype(np.uint32) << 16).view(np.float32) if raw == "BF16" else values
        if values.size and not np.isfinite(as_float).all():
            i = int(np.argwhere(~np.isfinite(as_float.reshape(-1)))[0][0])
            raise self.fail(suffix, "holds a non-finite value", f"value[{i}]", "finite", str(as_float.reshape(-1)[i]))


def check_weight(where: Where, module: str, shape: tuple[int, ...], s: MixScheme) -> None:
    """Gate ``qparams`` for one mixprec Linear of logical ``shape`` [out, in] (see the module docstring)."""
    n, k = shape
    g = s.group_size
    x = Tensors(where, module)
    stored = [int(v) for v in x.exact("weight_shape", (2,))]
    if stored != [n, k]:
        raise x.fail("weight_shape", "disagrees with the architecture", "value", [n, k], stored)
    if k % g:
        raise x.fail("weight_shape", f"K is not a multiple of the config's group size {g}", "value", f"K % {g} == 0", k)
    groups = n * (k // g)
    x.exact("weight_zero", (n, k // g))
    if "weight_scale" in suffixes(where, module):
        x.finite("weight_scale", x.exact("weight_scale", (n, k // g)))
    else:
        x.exact("weight_scale_codes", (n, k // g))
        scale2 = x.get(
            "weight_scale2", lambda d: len(d) == 2 and 1 <= d[0] <= n and d[1] == k // g, f"[1..{n}, {k // g}]"
        )
        x.finite("weight_scale2", scale2)
        x.exact("weight_zero2", scale2.shape)
    wide = x.get("weight_wide", lambda d: len(d) == 1 and d[0] <= groups, f"[W] with W <= {groups}").astype(np.int64)
    rows = x.get("weight_wide_rows", lambda d: len(d) == 1 and d[0] <= n, f"[R] with R <= {n}").astype(np.int64)
    problem = map_problem(n, k // g, wide, rows)
    if problem is not None:  # field ``wide[i]`` or ``wide_rows[i]``: entry i of that tensor
        slot, _, index = problem.field.partition("[")
        message = f"the precision map: {problem.message}"
        raise x.fail(f"weight_{slot}", message, f"value[{index}", problem.expected, problem.found)
    rowptr = x.exact("weight_rowptr", (n + 1,)).astype(np.int64)
    col = x.get("weight_col", lambda d: len(d) == 1, "[nnz]")
    x.finite("weight_value", x.exact("weight_value", tuple(col.shape)))
    if rowptr[0] != 0 or rowptr[-1] != col.shape[0] or np.any(np.diff(rowptr) < 0):
        found = f"{int(rowptr[0])} .. {int(rowptr[-1])}"
        raise x.fail(
            "weight_rowptr", "row pointers must run from 0 to the outlier count", "value", f"0 .. {col.shape[0]}", found
        )
    check_planes(x, n, k, g, wide.shape[0] + rows.shape[0] * (k // g))


def check_planes(x: Tensors, n: int, k: int, g: int, w: int) -> None:
    """The planes' exact length and their zero padding (the alignment is part of the layout)."""
    low, high = n * k // 4, w * g // 4
    size = pad(low) + pad(high)
    planes = x.exact("weight_planes", (size,))
    for lo, hi, what in ((low, pad(low), "low"), (pad(low) + high, size, "high")):
        nonzero = np.flatnonzero(planes[lo:hi])
        if nonzero.size:
            at = lo + int(nonzero[0])
            raise x.fail(
                "weight_planes",
                f"alignment padding after the {what} plane must be zero",
                f"padding[{at}]",
                0,
                int(planes[at]),
            )


def check_descriptors(m: Module, quantized: dict[str, object]) -> None:
    """Gate ``graph``: each mixprec descriptor is a target of the config, with its group size, and its
    slots are located at the table's container tensors."""
    weights = mixprec_weights(m)
    have = {w.module for w in weights}
    for module in sorted(m for m, s in quantized.items() if isinstance(s, MixScheme) and m not in have):
        raise ArtifactError(
            "the config says mixprec, graph.qir has no mixprec weight for it",
            file="graph.qir",
            tensor=f"{module}.weight",
            expected="a mixprec descriptor",
            found="none",
        )
    for w in weights:
        want = quantized.get(w.module)
        group = w.t.group.size if w.t.group is not None else None
        if not isinstance(want, MixScheme) or want.group_size != group:
            found = f"mixprec, group_size={group}"
            raise ArtifactError(
                "descriptor disagrees with the quantization config",
                file="graph.qir",
                tensor=w.name,
                expected=want,
                found=found,
            )
        for slot, tensor in w.refs.items():
            location = m.tensors[tensor].blob.location
            suffix = SUFFIX.get(slot, "")
            if not location.startswith("safetensors:") or not location.endswith(f"#{w.module}.{suffix}"):
                raise ArtifactError(
                    "a mixprec slot is located at another container tensor",
                    file="graph.qir",
                    tensor=tensor,
                    field=slot,
                    expected=f"safetensors:<shard>#{w.module}.{suffix}",
                    found=location,
                )
