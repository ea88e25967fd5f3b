"""``freeze-semantics``: turn the source's quantization state into immutable descriptors.

Every ``q.source_weight`` becomes ``q.weight`` (the descriptor, bound to its codes and qparams)
followed by ``q.dequantize``. Before that happens the pass proves the reference decoder reproduces
the source's effective weight bit for bit, or stops naming the tensor, index, expected and got. It
never quantizes: a float constant fed to ``q.quantize`` is refused, and with ``scheme`` set every
weight must have been quantized as that scheme. Provenance (source kinds, library versions) is
recorded on the module, and so is the block format each ``q.source_blocks`` weight came in
(``source_formats = {"w" = "TQ1_0"}``): a target that holds the codes exactly in more than one
format (TQ1_0 and TQ2_0) keeps the source's.

Before::

    %w = q.source_weight() {source = "qcompiler.dequantize_affine", codes = @fc1.weight.codes, ...} : tensor<f32[64,32]>

After::

    %w = q.weight() {codes = @fc1.weight.codes, scale = @fc1.weight.scale} : !q.affine<i4[-8:7] -> f32[64,32], ...>
    %w_dq = q.dequantize(%w) : tensor<f32[64,32]>
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from qcompiler.ir.attrs import AttrValue, SymbolRef
from qcompiler.ir.core import Graph, Module, Op, create_op
from qcompiler.ir.ops.dense import Embedding, Linear
from qcompiler.ir.ops.quant import SourceWeight
from qcompiler.ir.ops.quant_blocks import SourceBlocks
from qcompiler.ir.ops.quant_mixprec import SourceMixprec
from qcompiler.ir.ops.shapes import dense
from qcompiler.ir.rewrite import replace_uses
from qcompiler.ir.symbols import is_carried, referenced_tensors
from qcompiler.parallel import ordered_map
from qcompiler.passes.base import Pass, PassContext
from qcompiler.passes.freeze_blocks import ProvenBlocks, bind_blocks, prove_blocks
from qcompiler.passes.freeze_known import checker, evidence_for, frozen_ahead
from qcompiler.passes.freeze_mixprec import freeze_mixprec
from qcompiler.passes.freeze_steps import (
    Proven,
    bind_weight,
    prove_weight,
    provenance,
    refuse_invented_codes,
)
from qcompiler.proofs import key_of

if TYPE_CHECKING:
    from qcompiler.artifact.request import ArtifactRequest


PROOF_BYTES = 256 << 20
"""Codes or block bytes of the weights whose proofs run at once (a larger weight is proven alone)."""


def consumer_requirement(op: Op, users: dict[int, list[Op]]) -> str:
    uses = users.get(id(op.result), [])
    if uses and all(isinstance(u, Linear) and u.w is op.result for u in uses):
        return "linear"
    if uses and all(isinstance(u, Embedding) and u.w is op.result for u in uses):
        return "embedding"
    return "any"


def freeze_graph(
    m: Module,
    g: Graph,
    scheme: str,
    kinds: set[str],
    formats: dict[str, AttrValue],
    jobs: int = 1,
    request: ArtifactRequest | None = None,
) -> None:
    """Freeze every source weight of ``g``; the proofs of ``q.source_weight`` and ``q.source_blocks``
    ops run in ``jobs`` threads (they change nothing), their arrays are stored in op order. For an
    artifact ``request``, each proof's decode also gives its sha256 and rung 3's errors, recorded in
    ``request.proofs`` for the evidence on the reopened artifact (``qcompiler.proofs``)."""
    users = g.users()
    evidence = None if request is None else evidence_for(request.float_weights)

    def prove(op: Op) -> Proven | ProvenBlocks | None:
        if isinstance(op, SourceBlocks):
            return prove_blocks(m, op, consumer_requirement(op, users))
        if op.name != "q.source_weight":
            return None
        req = consumer_requirement(op, users)
        known = None if request is None else frozen_ahead(m, op, req, request.proofs, checker(scheme))
        return known if known is not None else prove_weight(m, op, req, scheme, evidence)

    def nbytes(op: Op) -> int:  # the weight's codes or blocks: what a proof holds, times a few
        ref = op.attrs.get("blocks", op.attrs.get("codes"))
        return m.tensors[ref.name].blob.nbytes if isinstance(ref, SymbolRef) and ref.name in m.tensors else 0

    out: list[Op] = []
    for op, proven in zip(list(g.ops), ordered_map(prove, list(g.ops), jobs, nbytes, PROOF_BYTES), strict=True):
        if not isinstance(op, SourceWeight | SourceBlocks | SourceMixprec):
            out.append(op)
            continue
        kinds.add(op.source)
        if isinstance(op, SourceBlocks):
            formats[str(op.blocks).removeprefix("@").removesuffix(".blocks")] = op.format
        req = consumer_requirement(op, users)
        if isinstance(op, SourceMixprec):
            weight = freeze_mixprec(m, op, req)
        elif isinstance(proven, ProvenBlocks):
            weight = bind_blocks(m, op, proven)
        else:
            assert proven is not None  # ``prove`` proved every q.source_weight
            weight = bind_weight(m, op, proven)
            if request is not None and proven.fact is not None:
                request.proofs.record(key_of(m, proven.name, weight, proven.type), proven.fact)
        dq = create_op("q.dequantize", [weight.result], [dense(op.result)], result_names=[f"{op.result.name}_dq"])
        out += [weight, dq]
        replace_uses(g, op.result, dq.result)
    g.ops = out


@dataclass(frozen=True)
class FreezeSemanticsPass(Pass):
    """Freeze quantization state into descriptors, proving decode == the source's effective weight."""

    name: ClassVar[str] = "freeze-semantics"
    summary: ClassVar[str] = "source quantization state -> immutable descriptors, proven exact"
    establishes: ClassVar[frozenset[str]] = frozenset({"semantics-frozen"})

    scheme: str = ""
    """If set (e.g. ``w4-g32``), every quantized weight must match this scheme."""

    def run(self, module: Module, ctx: PassContext) -> Module:
        refuse_invented_codes(module)
        kinds: set[str] = set()
        formats: dict[str, AttrValue] = {}
        for g in module.graphs:
            freeze_graph(module, g, self.scheme, kinds, formats, ctx.jobs, ctx.artifact)
        if formats:
            module.attrs["source_formats"] = formats
        used = referenced_tensors(module)
        for name in [n for n in module.tensors if n not in used and not is_carried(module, n)]:
            del module.tensors[name]
        prov = module.attrs.get("provenance")
        record: dict[str, AttrValue] = dict(prov) if isinstance(prov, dict) else {}
        if prov is not None and not isinstance(prov, dict):
            record["source"] = prov
        record.update(provenance(sorted(kinds), self.scheme))
        module.attrs["provenance"] = record
        ctx.count("freeze-semantics.weights", sum(1 for op in module.ops() if op.name == "q.weight"))
        return module
