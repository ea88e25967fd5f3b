"""The part of publishing every backend shares: after its files are written into the writer's temp
directory (hashed while written), reopen them once through the production reader, gather parity
evidence on what was reopened, build the manifest, and publish after the manifest gates and a check
that the directory holds exactly the listed files with the hashes computed while writing (no second
read of the bytes); the swap is a rename, so what was checked is what is published.

    with ArtifactWriter(req.out, fail_at=req.fail_at) as w:
        ... w.write_file(...) for every file ...
        finish(w, m, req, Finish(target="gguf", reopen=open_gguf_dir, versions={...}, ...))
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qcompiler.artifact.evidence import gather
from qcompiler.artifact.manifest import ARTIFACT_SCHEMA, GRAPH_VERSION, converter, files_sha256, rate_ledger
from qcompiler.artifact.reader import check_written
from qcompiler.artifact.request import ArtifactRequest, OpenedArtifact
from qcompiler.artifact.writer import ArtifactWriter
from qcompiler.errors import QcError
from qcompiler.ir.attrs import SymbolRef
from qcompiler.ir.core import BlobRef, Module, Op, TensorDecl
from qcompiler.ir.module_attrs import conversions
from qcompiler.ir.row_blocks import decoded_rows
from qcompiler.ir.types import QuantType
from qcompiler.parity import decoded, parts, weights


class EmitError(QcError):
    """The module cannot be written as the target's artifact, or what was written does not prove out."""


@dataclass
class Finish:
    """What a backend contributes to the manifest and how its files are reopened before publishing."""

    target: str
    reopen: Callable[[Path], OpenedArtifact]
    container: str
    versions: dict[str, Any] = field(default_factory=dict[str, Any])
    provenance: dict[str, Any] = field(default_factory=dict[str, Any])
    topology: dict[str, Any] = field(default_factory=dict[str, Any])
    stored: dict[str, int] = field(default_factory=dict[str, int])
    """Weight name -> bytes its container tensors take (the rate ledger's stored scope)."""
    all_params: int = 0


def relocated(m: Module, locations: dict[str, str], placed_only: bool = False) -> Module:
    """``m`` with each tensor's blob pointing at ``locations[name]`` (its bytes inside the container),
    for the artifact's ``graph.qir``; ``placed_only`` drops tensors the container does not hold."""
    return dataclasses.replace(
        m,
        tensors={
            n: TensorDecl(
                n, BlobRef(d.blob.dtype, d.blob.shape, d.blob.sha256, locations[n]), d.attrs, d.comments, d.loc
            )
            for n, d in m.tensors.items()
            if not placed_only or n in locations
        },
    )


class Rung2Reference(Mapping[str, "torch.Tensor | np.ndarray"]):
    """What the reopened artifact's decode must equal bit for bit, one weight at a time: the model's
    own weights, except for converted weights (and modules without a source at hand, or a streamed
    source, whose effective weights ``freeze-semantics`` proved equal to this decode), which are held
    to the decode of the module that was emitted; each conversion's own error is recorded beside."""

    def __init__(self, m: Module, req: ArtifactRequest) -> None:
        self.converted = {str(c["tensor"]) for c in conversions(m) if isinstance(c, dict)}
        streamed = str(m.attrs.get("provenance", {}).get("frontend", "")).startswith("streamed")  # type: ignore[union-attr]
        # a streamed source's effective weights (a pre-quantized format's decode, made again when read)
        # were proven equal to the emitted decode by freeze-semantics: not decoded a third time here
        self.m, self.effective = m, {} if streamed else req.effective
        self.ops = {name: (op, t) for name, op, t in weights(m)}
        self.label = "source effective weights" if self.effective else "emitted module"
        self.bound: dict[str, dict[str, object]] = {}
        self.lock = threading.Lock()
        if streamed:
            self.label = "emitted module (its decode proven equal to the source's by freeze-semantics)"

    def from_source(self, name: object) -> bool:
        """``name``'s reference is the source's effective weight (not a converted one)."""
        return bool(self.effective) and name not in self.converted and name in self.effective  # pyright: ignore[reportOperatorIssue]

    def __getitem__(self, name: str) -> torch.Tensor | np.ndarray:
        if self.from_source(name):
            return self.effective[name]
        if name in self:
            op, t = self.ops[name]
            return decoded(self.m, op, t)
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        if self.from_source(name):
            return True
        return name in self.ops and (not self.effective or name in self.converted)

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor | np.ndarray:
        """Rows ``[r0, r1)`` of ``self[name]`` without decoding the whole weight (``parity_rows.RowSource``);
        the emitted weight's parts are read once and kept for its next rows (two weights at most)."""
        if self.from_source(name):
            return self.effective[name][r0:r1]
        if name not in self:
            raise KeyError(name)
        op, t = self.ops[name]
        with self.lock:
            bound = self.bound.pop(name, None)
            if bound is None:
                bound = parts(self.m, op.attrs)
            self.bound[name] = bound
            while len(self.bound) > 2:
                del self.bound[next(iter(self.bound))]
        return decoded_rows(bound, t, r0, r1)

    def same_bound_bytes(self, name: str, other: Module, op: Op, t: QuantType) -> bool:
        """Whether ``other``'s weight ``name`` (``op``, descriptor ``t``) is this module's emitted one
        byte for byte: the same descriptor and every bound tensor of the same sha256, so its decode is
        the emitted module's decode without decoding it again (a reference held to the emitted module)."""
        if self.effective and name not in self.converted:
            return False
        mine = self.ops.get(name)
        if mine is None or mine[1] != t:
            return False

        def hashes(m: Module, attrs: Mapping[str, object], at: str = "") -> list[tuple[str, str]]:
            """(slot path, sha256) of every bound tensor, nested bindings (K-quant scales) included."""
            out: list[tuple[str, str]] = []
            for k, v in sorted(attrs.items()):
                if isinstance(v, SymbolRef):
                    out.append((at + k, m.tensors[v.name].blob.sha256))
                elif isinstance(v, dict):
                    out += hashes(m, v, f"{at}{k}.")  # pyright: ignore[reportUnknownArgumentType]
            return out

        return hashes(self.m, mine[0].attrs) == hashes(other, op.attrs)

    def __iter__(self) -> Iterator[str]:
        return iter(set(self.effective) | set(self.ops) if self.effective else self.ops)

    def __len__(self) -> int:
        return len(list(iter(self)))


def rung2_reference(m: Module, req: ArtifactRequest) -> Rung2Reference:
    return Rung2Reference(m, req)


def finish(w: ArtifactWriter, m: Module, req: ArtifactRequest, f: Finish) -> None:
    """Reopen the temp directory, prove rungs 1-3 on it, write the manifest, publish."""
    opened = f.reopen(w.tmp)
    reference = rung2_reference(m, req)
    evidence = gather(opened.module, reference, req.float_weights, jobs=req.jobs, proofs=req.proofs, probe_of=req.probe)
    if not evidence["ok"]:
        raise EmitError(
            "parity on the reopened artifact failed, nothing published: " + "; ".join(evidence["failures"][:3])
        )
    src = req.source
    config = (src.config if src else None) or {}
    model = weights(m)
    manifest: dict[str, Any] = {
        "target": f.target,
        "versions": {
            "container": f.container,
            "artifact_schema": ARTIFACT_SCHEMA,
            "quant_representation": sorted({f"{t.family}/decoder-{t.decoder}" for _, _, t in model}),
            "packing_layout": sorted({f"{t.pack.family}/v{t.pack.version}" for _, _, t in model}),
            "graph": GRAPH_VERSION,
            "required_kernels": [],
            **f.versions,
        },
        "model": {
            "architecture": (config.get("architectures") or ["?"])[0],
            "model_type": config.get("model_type"),
            "revision": src.revision if src else "",
        },
        "tokenizer_sha256": files_sha256(src.files) if src else None,
        "provenance": {
            "source": src.spec if src else "",
            "source_sha256": src.source_sha256 if src else "",
            "converter": converter(),
            "calibration": None,
            "pipeline": req.pipeline,
            "ir": m.attrs.get("provenance", {}),
            **f.provenance,
        },
        "topology": {"tp": 1, "pp": 1, "placement": "replicate", **f.topology},
        "rate_ledger": rate_ledger(m, f.stored, f.all_params, sum(r.size for r in w.files)),
        "conversions": m.attrs.get("conversions", []),
        "parity": evidence,
    }
    hashed = {r.path: r.sha256 for r in w.files}

    def last_check(root: Path) -> None:
        from qcompiler.artifact.derived import check_derived
        from qcompiler.backends import get_backend

        check_derived(root, check_written(root, hashed), opened, get_backend(f.target))

    w.publish(manifest, verify=last_check)
