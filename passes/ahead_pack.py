"""``pack-layouts``' step of the per-weight work done ahead (``passes/ahead.py``): a frozen weight's
codes packed for the target, recorded as a fact of the compile's ``Proofs`` that the pass takes."""

from __future__ import annotations

import numpy as np

from qcompiler.backends import get_backend
from qcompiler.frontend.stream import Recipes
from qcompiler.ir.blobs import read_blob
from qcompiler.ir.core import BlobRef, TensorDecl
from qcompiler.ir.layouts import find_layout
from qcompiler.ir.types import QuantType
from qcompiler.proofs import Key, Proofs, packed_key, refs_key


def pack_ahead(
    proofs: Proofs,
    target: str,
    model_dtype: str,
    name: str,
    t: QuantType,
    codes: np.ndarray,
    parts: dict[str, BlobRef],
    logical: Key,
) -> Recipes | None:
    """Pack weight ``name`` (its logical ``codes``, descriptor ``t`` and stored ``parts``) as
    ``target``'s plan says, with ``unpack(pack(Q)) == Q`` proven (``pack_codes``); returns how to
    make the logical codes again from the packed ones, or ``None`` when the plan packs nothing
    exactly. A ``PassError`` is left to the pass, which packs the weight and reports it."""
    from qcompiler.passes.pack_layouts import pack_codes

    plan = get_backend(target).plan(name, t, "", model_dtype)
    if plan.kind != "exact" or plan.pack is None or plan.pack.family == "logical":
        return None
    layout = find_layout(plan.pack.family, plan.pack.version)
    if layout is None:
        return None
    ref, new_t = pack_codes(layout, codes, t, plan.pack, name)
    proofs.pack(packed_key(logical, plan.pack), (ref, new_t))
    proofs.alias(refs_key(name, new_t, {**parts, "codes": ref}), logical)
    dtype, shape = layout.physical(new_t)

    def unpacked() -> np.ndarray:
        stored = np.frombuffer(read_blob(TensorDecl(f"{name}.codes", ref)), dtype=np.dtype(dtype.numpy))
        return layout.unpack(stored.reshape(shape), new_t)

    return {"codes": unpacked}
