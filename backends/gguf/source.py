"""A ``.gguf`` file as a compile SOURCE: its codes and qparams read as they are, frozen, never requantized.

``qcompiler compile model.gguf --target gguf|safetensors -o OUT`` opens the file with the strict reader
(``reader.py``), rebuilds the transformers config from its metadata (``source_config.CONFIG_KEYS``), builds the
transformers model on fake tensors (nothing is allocated for its weights), and then streams every GGUF
tensor into it, one at a time (``rebuilt.Filler``): a dense one becomes a blob-store recipe that reads
it again, a quantized one a module whose buffers go to the blob store, swapped in as a fake copy
(with ``--scheme``, which quantizes a float file, ``frontend/requantize.py`` then quantizes the streamed
model weight by weight; ``streamed=False`` fills it in memory, for what only that path does):

| ggml type | becomes | exact because |
|---|---|---|
| F32 | the float parameter | the same values |
| F16, BF16 | the parameter, kept in its dtype (widened where the graph reads it) | the same bits |
| Q8_0, Q4_0, Q5_0 | ``QuantLinear``/``QuantEmbedding``: codes + f16 scale per 32 | the block's own fields |
| Q4_1, Q5_1, Q4_K, Q5_K, Q6_K, TQ1_0, TQ2_0 | ``GgmlLinear``/``GgmlEmbedding`` (blocks) | decode proven == ggml's |

(For the block types, ``freeze-semantics`` proves the descriptor's decode equals ggml's dequantize, bit
for bit.)

Any other ggml type is refused, naming the tensor and type. llama's ``attn_q``/``attn_k`` rows are put
back into transformers' order by the inverse of ``qk_row_permutation`` (whole block rows move; no value
changes). A file without ``output.weight`` has its output tied to ``token_embd``: the head then reads the
embedding's own quantized buffers, so every artifact stores the table once.

The tokenizer and every other ``tokenizer.*`` key travel verbatim (``SourceInfo.metadata["gguf"]``), so
a GGUF target re-emits them as they were.

Given the compile's ``Work`` (``api.source_work``), the quantized layers are read in ``jobs`` threads, and
where a child can export (``forked.available``) the model first stands on their fake copies and the
layers are read beside the export (``Capturable.reading``); each Q8_0/Q4_0/Q5_0 layer is then frozen
and packed for the target where it is read (``Work.ahead``: ``passes/ahead.py``), so the passes do not
read it again.

What is not GGUF-specific (the model built on fake tensors, the filling of each parameter and its
tied aliases, the check that none is left unfilled, the checkpoint state) is the frontend's
``rebuilt.py``, beside the other sources; ``Importer`` says which GGUF tensor fills what, and how.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from qcompiler.artifact.reader import sha256_file
from qcompiler.artifact.request import SourceInfo, model_dtype
from qcompiler.backends.gguf.archs import ARCHS, Arch
from qcompiler.backends.gguf.codecs import get_codec
from qcompiler.backends.gguf.ggml_types import GGMLType
from qcompiler.backends.gguf.quant_blocks import GgmlEmbedding, GgmlLinear
from qcompiler.backends.gguf.reader import GGUFError, GGUFFile, open_gguf
from qcompiler.backends.gguf.source_config import CONFIG_KEYS, source_config
from qcompiler.backends.gguf.writer import KV, GGUFValueType
from qcompiler.frontend.hf import Capturable, Reading, wrap_hf
from qcompiler.frontend.rebuilt import Filler, Work, float_model, imported_state
from qcompiler.frontend.skeleton import fake_model, parameters_on_meta, real_buffers
from qcompiler.frontend.stand_ins import template_args
from qcompiler.ir.blobs import derived, hashed
from qcompiler.ir.core import BlobRef
from qcompiler.ir.dtypes import DTYPES
from qcompiler.quant.modules import QuantEmbedding, QuantLinear
from qcompiler.quant.rtn import AffineQuant
from qcompiler.quant.schemes import parse_scheme

MODEL_ARGS = {"bert": {"add_pooling_layer": False}}
"""Constructor arguments of the transformers model of an architecture, where it takes any."""
KEPT = {GGMLType.BF16: "bf16", GGMLType.F16: "f16"}
"""Dense ggml types a streamed source keeps (``Importer.reference``), by IR dtype."""
DENSE = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}
AFFINE = ("Q8_0", "Q4_0", "Q5_0")
BLOCKS = ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0")
CARRIED_KEYS = ("tokenizer.", "general.name", "general.basename", "general.license", "bert.pooling_type")
"""Metadata a GGUF target re-emits verbatim from a GGUF source."""


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def build_model(arch: Arch, config: dict[str, Any]) -> nn.Module:
    """The transformers model of ``config``, parameters where the current mode puts them."""
    return float_model(config, causal=arch.name != "bert", **MODEL_ARGS.get(arch.name, {}))


class Importer(Filler):
    """Puts one GGUF file's tensors into a transformers model (see the module docstring)."""

    kind = "GGUF"

    def __init__(
        self,
        f: GGUFFile,
        arch: Arch,
        config: dict[str, Any],
        model: nn.Module,
        mode: FakeTensorMode | None = None,
        work: Work | None = None,
    ) -> None:
        super().__init__(model, mode, work)
        self.f, self.arch, self.config = f, arch, config
        self.gguf_of = {names[0]: arch.gguf_name(names[0]) for names in self.owners.values()}

    def fail(self, where: str, field: str, message: str, expected: str = "", found: object = "") -> GGUFError:
        return GGUFError(message, file=str(self.f.path), where=where, field=field, expected=expected, found=str(found))

    def tensor_of(self, hf: str) -> str:
        g = self.gguf_of[hf]
        assert g is not None  # check_inventory
        return g

    def shape_of(self, src: str) -> tuple[int, ...]:
        return tuple(self.f.tensors[src].shape)

    def size_of(self, src: str) -> int:
        return int(self.f.tensors[src].nbytes)

    def kind_of(self, hf: str, src: str) -> tuple[object, ...] | None:
        """Layers of one ggml type and shape filling the same kind of module (``standing``)."""
        mod = self.original(hf)
        if not isinstance(mod, nn.Linear | nn.Embedding):
            return None  # ``translated`` names the problem
        info = self.f.tensors[src]
        return (info.type_id, tuple(info.shape), type(mod).__name__, template_args(mod))

    def is_dense(self, src: str) -> bool:
        return GGMLType(self.f.tensors[src].type_id) in (*DENSE, GGMLType.BF16)

    def check_inventory(self) -> None:
        want = {g: hf for hf, g in self.gguf_of.items() if g is not None}
        for hf, g in self.gguf_of.items():
            if g is None:
                message = f"transformers parameter with no GGUF tensor in llama.cpp's {self.arch.name}"
                raise self.fail(hf, "name", message)
            if g not in self.f.tensors:
                raise self.fail(g, "tensor", f"missing (transformers {hf} needs it)", "present", "absent")
        for g in self.f.tensors:
            if g not in want:
                raise self.fail(
                    g, "tensor", f"not a tensor this importer maps for {self.arch.name}", "a known tensor", g
                )

    def rows(self, hf: str, arr: np.ndarray) -> np.ndarray:
        """A copy of ``arr`` (a read-only map of the file) with rows in transformers' order (llama's Q/K
        rows un-permuted)."""
        perm = self.arch.row_permutation(hf, self.config, int(arr.shape[0]))
        return np.array(arr if perm is None else arr[np.argsort(perm)], order="C", copy=True)

    def dense(self, hf: str, src: str) -> torch.Tensor:
        info = self.f.tensors[src]
        gt = GGMLType(info.type_id)
        if gt == GGMLType.BF16:
            raw = np.asarray(self.f.array(src)).astype(np.uint32) << 16
            arr = raw.view(np.float32)
        elif gt in DENSE:
            arr = np.asarray(self.f.array(src)).astype(np.float32)
        else:
            raise self.fail(
                src, "type", "a 1-D tensor or a float-only parameter must be F32/F16/BF16", "float", gt.name
            )
        if self.arch.is_shifted(hf):  # the file holds 1 + w (Gemma's norms)
            arr = arr - np.float32(1.0)
        return torch.from_numpy(self.rows(hf, arr))

    def reference(self, hf: str, src: str) -> BlobRef:
        """A dense tensor as a recipe (hashed here, made again from the file when read), rows in
        transformers' order: BF16 and F16 kept in their dtype (the graph widens them where it reads
        them, and a GGUF target writes them back as they were), anything else, and Gemma's shifted
        norms, as the float32 parameter."""
        kept = KEPT.get(GGMLType(self.f.tensors[src].type_id))
        if kept is None or self.arch.is_shifted(hf):
            dtype, make = "f32", lambda: self.dense(hf, src).numpy()
        else:
            dtype, make = kept, lambda: self.kept_rows(hf, src)
        ref, _ = hashed(make(), DTYPES[dtype])
        derived(ref, make)
        return ref

    def kept_rows(self, hf: str, src: str) -> np.ndarray:
        """A BF16/F16 tensor's stored values, rows in transformers' order, in memory this process owns
        (one read of the file, never its map: what the blob store hashes is then what is used, and a
        1 GB embedding is held once; a copy of the map here was a 1 GB embedding more at 8B)."""
        arr = np.asarray(self.f.array(src))  # shape and dtype; no page of it is read here
        perm = self.arch.row_permutation(hf, self.config, int(arr.shape[0]))
        if perm is None:
            return np.frombuffer(self.f.read(src), dtype=arr.dtype).reshape(arr.shape)
        return arr[np.argsort(perm)]

    def quantized(self, hf: str, src: str, mod: nn.Module) -> nn.Module:
        info = self.f.tensors[src]
        gt = GGMLType(info.type_id)
        self.check_shape(hf, src, tuple(mod.weight.shape))  # type: ignore[union-attr]
        blocks = self.rows(hf, np.asarray(self.f.array(src)))
        n = int(info.shape[-1])
        source = {"kind": "gguf", "type": gt.name}
        bias = getattr(mod, "bias", None)
        if gt.name in AFFINE:
            parts = get_codec(gt).split(blocks)
            s = parse_scheme(gt.name.lower())
            q = AffineQuant(
                torch.from_numpy(np.ascontiguousarray(parts["codes"], dtype=np.int8)),
                torch.from_numpy(np.ascontiguousarray(parts["scale"], dtype=np.float16)),
                None,
                s.qmin,
                s.qmax,
                32,
            )
            if isinstance(mod, nn.Embedding):
                return QuantEmbedding(q, mod.padding_idx, torch.float32, source)
            return QuantLinear(q, bias, torch.float32, source)
        if gt.name in BLOCKS:
            if gt == GGMLType.TQ2_0 and (get_codec(gt).split(blocks)["codes"] > 1).any():
                raise self.fail(src, "codes", "TQ2_0 code 3 (+2d) has no ternary meaning", "trits {-1, 0, 1}", 2)
            if isinstance(mod, nn.Embedding):
                made: nn.Module = GgmlEmbedding(blocks, gt.name, n, mod.padding_idx, torch.float32)
            else:
                made = GgmlLinear(blocks, gt.name, n, bias, torch.float32)
            made.source = source  # type: ignore[assignment]
            return made
        supported = ", ".join(["F32", "F16", "BF16", *AFFINE, *BLOCKS])
        raise self.fail(src, "type", "this ggml type cannot be imported (yet)", f"one of {supported}", gt.name)


def carried_metadata(f: GGUFFile) -> list[KV]:
    """The source's tokenizer (and name, licence, pooling) keys as writer KVs, exactly as typed."""
    out: list[KV] = []
    for key, (vtype, value) in f.metadata.items():
        if not key.startswith(CARRIED_KEYS):
            continue
        elem = f.array_types.get(key)
        out.append(KV(key, GGUFValueType(vtype), value, None if elem is None else GGUFValueType(elem)))
    return out


def load_gguf_source(spec: str, streamed: bool = True, work: Work | None = None) -> Capturable:
    """``spec`` (a ``.gguf`` file) as a ``Capturable`` carrying its ``SourceInfo`` and checkpoint state;
    ``streamed``: the model holds no weight (see the module docstring), else it is filled in memory
    (what a whole-model ``--scheme``, or a tie only the in-memory quantizer answers, reads). ``work``:
    threads, the per-layer hook and whether the layers are read beside the export (streamed only)."""
    path = Path(spec)
    f = open_gguf(path)
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="qc-source-sha256") as pool:
        digest = pool.submit(sha256_file, path, stop)  # provenance, hashed beside the model's building
        try:
            cap, config = filled(f, spec, streamed, work)
            sha = digest.result()
        finally:
            stop.set()
    assert sha is not None  # only a stopped hashing gives none
    cap.source = SourceInfo(spec, config, {}, sha, "gguf file", metadata={"gguf": carried_metadata(f)})
    return cap


def filled(f: GGUFFile, spec: str, streamed: bool, work: Work | None) -> tuple[Capturable, dict[str, Any]]:
    """``load_gguf_source`` but the file's hash: the model built and filled from ``f``, and its config."""
    path = Path(spec)
    arch_value = f.metadata.get("general.architecture", (0, None))[1]
    arch = ARCHS.get(str(arch_value)) if str(arch_value) in CONFIG_KEYS else None
    if arch is None:  # a model written here but not read back yet (gpt2: its Conv1D weights are [K, N])
        raise GGUFError(
            "architecture not importable",
            file=str(path),
            where="general.architecture",
            field="value",
            expected=" or ".join(CONFIG_KEYS),
            found=str(arch_value),
        )
    config = source_config(arch, f)
    if streamed:
        model, mode = fake_model(lambda: build_model(arch, config))
    else:
        with parameters_on_meta():
            model, mode = build_model(arch, config), None
    work = work or Work()
    importer = Importer(f, arch, config, model, mode, work if streamed else Work(work.jobs))
    if streamed and work.ahead is not None:
        importer.hook = work.ahead(model_dtype(SourceInfo(spec, config)))
    importer.run()
    cap = wrap_hf(model, path.stem)
    if streamed:
        cap.lazy, cap.buffers = importer.lazy, real_buffers(lambda: build_model(arch, config))
    if importer.deferred:
        cap.reading = Reading(importer.placeholders(), importer.pending)
    cap.provenance.update({"source_format": "gguf/3", "source_file": path.name})
    cap.state = imported_state(model, (GgmlLinear, GgmlEmbedding, QuantLinear, QuantEmbedding))
    return cap, config
