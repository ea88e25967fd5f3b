"""The mixed 2/4-bit kernels (``mixprec_codegen``) as runtime kernels: a ``KernelSpec`` per ``MixKey`` and phase.

``specs(key)`` declares what the generated module accepts: family ``mixprec``, codes ``u4``, a
second-level quantized scale (``scale_dtypes = {"quantized"}``), the key's group, layout ``mixprec/v1``,
CUDA capability >= 8.0, the ``decode`` phase (split-K + reduce) and the ``prefill`` phase (tiled GEMM),
sharing one prepared weight. What the fields cannot say is the ``predicate``: the weight's second-level
group and whether it has outliers must be the key's, then ``admit_mixprec`` checks the layout id, the
precision map, the nested qparams, the exception semantics, the local K against the vector width, and
the kernels' shared memory and registers against the place's ``DeviceLimits``.

``prepare`` is a load-time repack (``repack`` says so; the memory ledger counts it apart): the stored
planes are unpacked through the precision map, then ``mixprec_run.prepare`` builds the kernel inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from qcompiler.backends.triton import mixprec_plan
from qcompiler.backends.triton.mixprec_codegen import MixKey, admit_mixprec
from qcompiler.backends.triton.mixprec_run import MixWeight, prepare, run_mixprec
from qcompiler.backends.triton.parity import INTERPRET, MAX_COLUMNS, KernelParity
from qcompiler.backends.triton.runtime import ERROR_BOUND, MIN_CAPABILITY
from qcompiler.ir.core import Module, Op
from qcompiler.ir.interpret import TORCH
from qcompiler.ir.layouts import logical_view
from qcompiler.ir.mixprec import EXCEPTION_SEMANTICS, four_bit, wide_count
from qcompiler.ir.types import QuantType
from qcompiler.parity import decoded, parts
from qcompiler.runtime.kernels import KernelSpec, Place, Signature, ensure_registered
from qcompiler.runtime.rungs import rel

REPACK = (
    "planes unpacked through the precision map and split again: the low plane as stored, the 4-bit groups' "
    "high plane reordered column-major per N tile (hbase i32, hrank u8); zero, scale codes, scale2, zero2 "
    "transposed to [K/G, rows]; outlier columns widened to int32, the longest CSR row per N tile"
)
NESTED_NAMES = {"codes": "scale_codes", "scale": "scale2", "zero": "zero2"}
"""The nested scale's binding names -> the names ``admit_mixprec`` checks for."""
PREDICATE = (
    "second-level group and outliers as the key's; then admit_mixprec: layout id, precision map, nested "
    "qparams, exception semantics, local K % vector K, shared memory and registers against the device"
)


def mix_weight(m: Module, op: Op, t: QuantType) -> MixWeight:
    """The logical arrays of one stored ``mixprec`` weight (codes unpacked from their layout)."""
    p: dict[str, Any] = parts(m, op.attrs)
    codes, _ = logical_view(p["codes"], t, p)
    scale = p["scale"]
    assert t.group is not None
    assert isinstance(scale, dict)
    n, k = (int(d) for d in t.shape)
    wide = four_bit(n, k // t.group.size, p["wide"], p["wide_rows"])  # every 4-bit group, flat order
    return MixWeight(
        codes, wide, p["zero"], scale["codes"], scale["scale"], scale["zero"],
        p["rowptr"], p["col"], p["value"], t.group.size, mixprec_plan.group2(t),
    )  # fmt: skip


def first_rows(w: MixWeight, n: int) -> MixWeight:
    """The weight's first ``n`` output rows (every stream cut where those rows end)."""
    k = w.shape[1]
    rows2 = -(-n // w.group2)
    end = int(w.rowptr[n])
    return MixWeight(
        w.codes[:n], w.wide[w.wide < n * (k // w.group)], w.zero[:n], w.scale_codes[:n], w.scale2[:rows2],
        w.zero2[:rows2], w.rowptr[: n + 1], w.col[:end], w.value[:end], w.group, w.group2,
    )  # fmt: skip


def precisions(t: QuantType) -> set[int]:
    n, k = (int(d) for d in t.shape)
    assert t.group is not None
    wide, groups = wide_count(t), n * (k // t.group.size)
    return ({2} if wide < groups else set()) | ({4} if wide else set())


def slots(t: QuantType) -> list[str]:
    scale = t.qparam("scale")
    nested = [NESTED_NAMES[s] for s in ("codes", *dict(scale.qparams))] if isinstance(scale, QuantType) else []
    return ["codes", *(s for s in t.slots() if s != "scale"), *nested]


def predicate_for(key: MixKey) -> Any:
    def predicate(sig: Signature, t: QuantType, place: Place) -> str | None:
        if place.limits is None:
            return "the device states no shared memory and register limits"
        g2, outliers = mixprec_plan.group2(t), mixprec_plan.outliers(t) > 0
        if g2 != key.group2:
            return f"second-level groups of {g2} rows, the kernel decodes {key.group2}"
        if outliers != key.outliers:
            have, built = "outliers" if outliers else "no outliers", "with" if key.outliers else "without"
            return f"{have}, the kernel is built {built} the outlier correction"
        layout = (t.pack.family, t.pack.version, t.pack.encoding)
        return admit_mixprec(key, layout, precisions(t), slots(t), EXCEPTION_SEMANTICS, sig.k, place.limits.as_dict())

    return predicate


def admission(key: MixKey) -> dict[str, Any]:
    """What every kernel of ``key`` declares to the registry (the signature fields it accepts)."""
    return {
        "device": "cuda",
        "min_capability": MIN_CAPABILITY,
        "families": frozenset({"mixprec"}),
        "codes": frozenset({"u4"}),
        "zero": "int",
        "scale_dtypes": frozenset({"quantized"}),
        "groups": frozenset({key.group}),
        "activations": frozenset({key.act}),
        "outputs": frozenset({key.out}),
        "epilogues": frozenset({"bias"}) if key.bias else frozenset(),
        "needs_bias": key.bias,
        "perm": "none",
        "layouts": frozenset({"mixprec/v1"}),
        "repack": REPACK,
        "error_bound": ERROR_BOUND[key.act],
    }


PHASES = {"decode": frozenset({"decode"}), "prefill": frozenset({"prefill"})}


def admission_json(key: MixKey) -> dict[str, Any]:
    """``admission`` per registered kernel id, as JSON: what ``kernels/index.json`` says."""
    declared = {k: sorted(v) if isinstance(v, frozenset) else v for k, v in admission(key).items()}
    return {
        f"triton.{key.id}.{fn}": {"op": "q.linear", "phases": sorted(p), **declared, "predicate": PREDICATE}
        for fn, p in PHASES.items()
    }


def prepare_for(key: MixKey) -> Any:
    def prepare_weight(m: Module, op: Op, t: QuantType, place: Place) -> dict[str, Any]:
        return prepare(key, mix_weight(m, op, t), place.torch_device, place.interpret, place.sms)

    return prepare_weight


def run_for(key: MixKey, phase: str) -> Any:
    def run(h: dict[str, Any], x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return run_mixprec(key, phase, h, x, bias)

    return run


def specs(key: MixKey) -> list[KernelSpec]:
    """The registered kernels of ``key`` (already registered ones are returned as they are)."""
    common: dict[str, Any] = {**admission(key), "prepare": prepare_for(key), "shares": f"triton.{key.id}"}
    return [
        ensure_registered(
            KernelSpec(
                f"triton.{key.id}.{fn}",
                "q.linear",
                "packed",
                phases=served,
                run=run_for(key, fn),
                predicate=predicate_for(key),
                **common,
            )
        )
        for fn, served in PHASES.items()
    ]


def parity(
    m: Module, w: Op, t: QuantType, key: MixKey, rows: tuple[int, ...] = (1, 5), place: Place = INTERPRET
) -> list[KernelParity]:
    """Each kernel (decode at each of ``rows``, prefill) against the float64 product with the reference
    decode, on the first ``MAX_COLUMNS`` output rows of one stored weight (kernel error only)."""
    n = min(int(t.shape[0]), MAX_COLUMNS)
    weight = first_rows(mix_weight(m, w, t), n)
    h = prepare(key, weight, place.torch_device, place.interpret, place.sms)
    ref = torch.from_numpy(np.ascontiguousarray(decoded(m, w, t)[:n])).double()
    gen = torch.Generator().manual_seed(0)
    out: list[KernelParity] = []
    bias = torch.randn(n, generator=gen) if key.bias else None
    for phase, mrows in [("decode", r) for r in rows] + [("prefill", max(rows) + 2)]:
        x = torch.randn(mrows, ref.shape[1], generator=gen).to(TORCH[key.act])
        b = None if bias is None else bias.to(TORCH[key.out])
        dev = place.torch_device
        y = run_mixprec(key, phase, h, x.to(dev), None if b is None else b.to(dev)).cpu().double()
        want = x.double() @ ref.T + (0 if b is None else b.double())
        out.append(KernelParity(f"{key.id}.{phase}[M={mrows}]", rel(y, want), None, ERROR_BOUND[key.act]))
    return out
