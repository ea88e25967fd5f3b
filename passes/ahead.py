"""The per-weight work of ``freeze-semantics`` and ``pack-layouts``, done ahead by the stream.

A streamed compile quantizes each weight in a worker of the stream (``frontend/stream.py``) while
its float values are in memory; the two passes would later read its codes back from the blob store,
one weight at a time, to describe and prove them, and the float rows back from the source for rung
3. ``Ahead`` does their work right there, in the worker:

1. ``freeze-semantics``' steps: the descriptor (``describe``), the proof that the reference decode
   equals the source's own dequantize (``prove_source_rows``), and, from the same decode, its digest
   (``decode_digest``) and rung 3's errors against the float weight held in memory (``DecodeEvidence``);
2. ``pack-layouts``' steps for the compile's target (``ahead_pack.py``): the backend's plan, the
   packed codes, and the proof ``unpack(pack(Q)) == Q``.

A pre-quantized source (``backends/safetensors/prequant.py``) calls ``Ahead.prequantized`` on each
layer it reads with the format's decode, made once and hashed as the op's ``effective`` operand:
the same steps, proven against it (``prove_exact``).

Each result is a fact of the compile's ``Proofs`` (``qcompiler.proofs``) keyed by the inputs the pass
will see: the tensors' sha256s, the attributes, the descriptor, the target's layout. A pass meeting a
weight with the same inputs takes the result (``frozen_key``, ``Proofs.frozen``; ``packed_key``,
``Proofs.packed_as``) instead of reading the weight again; any other weight (another consumer than
predicted, a conversion, a pass in between that changed it, a failure here, which the pass then
raises with its own message) is done by the pass as before. The output bytes are the same either
way: the same functions compute them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from qcompiler.errors import QcError
from qcompiler.frontend.context import TORCH_DTYPES
from qcompiler.frontend.stream import Recipes
from qcompiler.ir.blobs import put_array
from qcompiler.ir.core import BlobRef
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.types import DenseType
from qcompiler.parity import rung3_input
from qcompiler.parity_rows import DecodeEvidence
from qcompiler.passes.ahead_pack import pack_ahead
from qcompiler.passes.freeze_known import frozen_key, part_dtype
from qcompiler.proofs import DecodeFact, Frozen, Proofs, refs_key
from qcompiler.quant.describe import describe

REQUIREMENTS = {"QuantLinear": "linear", "QuantEmbedding": "embedding"}
"""The consumer a quantized module's weight will have in the graph (``consumer_requirement``)."""


def requirement(module: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> str | None:
    """The predicted consumer of a module's weight the hook takes (2-D codes in group order), else ``None``."""
    codes, scale = arrays.get("codes"), arrays.get("scale")
    if codes is None or scale is None or codes.ndim != 2 or "g_idx" in arrays:
        return None
    return REQUIREMENTS.get(type(module).__name__)


@dataclass(frozen=True)
class Ahead:
    """The worker's hook (see the module docstring): ``target`` is the backend ``pack-layouts`` will
    pack for (``None``: freeze only), ``model_dtype`` the source's (the backend's plan reads it)."""

    proofs: Proofs
    target: str | None = None
    model_dtype: str = ""

    def __call__(
        self,
        name: str,
        module: torch.nn.Module,
        refs: Mapping[str, BlobRef],
        arrays: Mapping[str, np.ndarray],
        weight: torch.Tensor | None,
        source: tuple[BlobRef, np.ndarray] | None = None,
    ) -> Recipes | None:
        """Freeze (and pack) weight ``name``, quantized into ``module``, whose buffers ``arrays`` the
        stream stores as ``refs``; ``weight`` is the float weight (``source``: ``freeze``). Records
        facts, raises nothing; once packed, returns how to make the logical codes from the packed
        ones (``blobs.derived``)."""
        req = requirement(module, arrays)
        if req is None:
            return None
        try:
            return self.freeze(name, module, req, refs, arrays, weight, source)
        except QcError:
            return None  # the pass proves this weight itself and reports what fails

    def prequantized(
        self,
        name: str,
        module: torch.nn.Module,
        refs: Mapping[str, BlobRef],
        arrays: Mapping[str, np.ndarray],
        effective: BlobRef,
        decode: np.ndarray,
    ) -> None:
        """A pre-quantized layer frozen (and packed) against ``decode``, the format's own decode, which
        the source stored as blob ``effective`` (the op's operand). Records facts, raises nothing."""
        self(name, module, refs, arrays, None, (effective, decode))

    def freeze(
        self,
        name: str,
        module: torch.nn.Module,
        req: str,
        refs: Mapping[str, BlobRef],
        arrays: Mapping[str, np.ndarray],
        weight: torch.Tensor | None,
        source: tuple[BlobRef, np.ndarray] | None = None,
    ) -> Recipes | None:
        """``weight``: the float weight the codes were quantized from (rung 3's quantization error);
        ``source``: the effective weight the decode must equal (its blob and values), else the
        source's own dequantize of the codes (``Affine``)."""
        from qcompiler.passes.freeze_proof import Affine, prove_exact, prove_source_rows

        codes, scale, zero = arrays["codes"], arrays["scale"], arrays.get("zero")
        group, qmin, qmax = int(module.group), int(module.qmin), int(module.qmax)  # pyright: ignore[reportArgumentType]
        expressed = DenseType(DTYPES[TORCH_DTYPES[module.out_dtype]], tuple(int(d) for d in codes.shape))  # pyright: ignore[reportArgumentType]
        block = [1, group]
        scale_dtype = refs["scale"].dtype.name
        where = f"tensor @{name}"
        d = describe(where, codes, scale, zero, block, qmin, qmax, expressed, req, None, scale_dtype)
        x = rung3_input(name, int(codes.shape[1])) if req == "linear" else None
        ev = DecodeEvidence(x, int(codes.shape[0]), None if weight is None else lambda r0, r1: weight[r0:r1])
        tensors = {k: r.sha256 for k, r in refs.items() if k in ("codes", "scale", "zero")}
        if source is None:
            prove_source_rows(where, d, Affine(codes, scale, zero, group, qmin, qmax), ev)
        else:
            eff, values = source
            prove_exact(where, d.type, d.arrays, values, ev)
            tensors["effective"] = eff.sha256
        parts: dict[str, BlobRef] = {}
        for part, arr in d.arrays.items():
            given = arrays.get(part)
            same = given is arr and refs[part].dtype == part_dtype(d.type, part, arr)
            parts[part] = refs[part] if same else put_array(arr, part_dtype(d.type, part, arr))
        fact = DecodeFact(ev.digest(), ev.rung3())
        key = frozen_key(name, tensors, block, qmin, qmax, expressed, req, scale_dtype)
        logical = refs_key(name, d.type, parts)
        self.proofs.freeze(key, Frozen(d.type, parts, fact))
        self.proofs.record(logical, fact)
        if self.target is None or parts["codes"] is not refs["codes"]:
            return None
        return pack_ahead(self.proofs, self.target, self.model_dtype, name, d.type, d.arrays["codes"], parts, logical)
