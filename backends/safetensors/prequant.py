"""A pre-quantized HF directory as a compile SOURCE: GPTQ, AWQ and compressed-tensors checkpoints, their
codes and qparams read as stored and frozen, never requantized and never decompressed by a library.

``qcompiler compile DIR --target ...`` on a directory whose ``config.json`` holds a
``quantization_config`` (or an older repository's ``quantize_config.json`` / ``quant_config.json``)
comes here (the ``PREQUANTIZED`` table of this package, keyed by method). The model is built from the
config on the meta device (``frontend/rebuilt.py``) and filled tensor by tensor:

- a quantized ``Linear`` (its format's tensors present: ``qweight`` or ``weight_packed``...) becomes a
  ``QuantLinear`` holding the layer's codes, scales and zero points as the format stores them
  (``gptq_awq.py``, ``prequant_formats.py``: unsigned codes become signed by ``- 2^(b-1)``, which
  changes no decode), and, in act order, the group of each input column (``g_idx``); an FP8 layer
  (compressed-tensors ``float-quantized``) becomes a ``Float8Linear`` holding the ``F8_E4M3`` bytes
  as uint8 codes and its scales;
- every other tensor is the dense parameter, kept in its stored dtype in the artifact (the graph
  widens it where it reads it);
- a tensor no parameter takes, a parameter no tensor fills, or a layer whose tensors do not fit its
  shape is a typed error naming the file, tensor and field. Names, and every quantized part's dtype
  and shape (``Layer.expects``), are checked from the safetensors headers before any tensor is read
  (``check_inventory``). Nothing is initialised randomly.

Each layer's effective weight is the format's own published decode, computed from the stored tensors
by the formula (``reference``); ``freeze-semantics`` proves our descriptor decodes to it bit for bit.
The decode is made once per layer, where the layer is read (``QuantDir.held_apart``, in ``--jobs``
threads): hashed as the op's ``effective`` operand (a recipe: made again only if something reads it)
and handed to the compile's per-layer hook (``Ahead.prequantized``), which proves and packs the layer
there; the lowering takes the reference and never decodes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from qcompiler.artifact.manifest import TOKENIZER_FILES, canonical_sha256, digests_sha256
from qcompiler.artifact.request import SourceInfo
from qcompiler.backends.safetensors.container import SafetensorsFile, open_file
from qcompiler.backends.safetensors.gptq_awq import Expect, LayoutError
from qcompiler.backends.safetensors.source import CheckpointError, Declared, checkpoint_inventory, resolved
from qcompiler.frontend.forked import placeholder
from qcompiler.frontend.hf import Capturable, Reading, wrap_hf
from qcompiler.frontend.hf_dir import quiet_transformers, read_config
from qcompiler.frontend.reading import ST_IR
from qcompiler.frontend.rebuilt import Filler, Work, float_model, imported_state
from qcompiler.frontend.skeleton import fake_model, real_buffers
from qcompiler.ir.blobs import BlobRef, derived, hashed, keep_bytes, spill_active
from qcompiler.ir.dtypes import DTYPES
from qcompiler.paths import SOURCE, open_in, read_bounded, sha256_in
from qcompiler.quant.float8 import Float8Linear
from qcompiler.quant.modules import QuantEmbedding, QuantLinear
from qcompiler.quant.rtn import AffineQuant

MAX_CARRIED_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Layer:
    """How one quantized ``Linear``'s tensors are read: the suffixes it consumes (``main`` fills the
    weight), and the format's translation to our affine form and its published decode."""

    main: str
    parts: tuple[str, ...]
    scale: str
    """The suffix of the scales, kept in their stored dtype."""
    transposed: bool
    """Scales stored ``[groups, out]`` (GPTQ, AWQ) rather than ``[out, groups]``."""
    translate: Callable[[dict[str, np.ndarray], int, int], dict[str, Any]]
    """Stored arrays -> signed ``codes`` ``[N, K]``, ``zero`` (or ``None``), ``qmin``, ``qmax``, ``group``,
    ``g_idx`` (int32 ``[K]`` in act order, else ``None``); FP8: uint8 codes and ``family`` ``f8e4m3``."""
    reference: Callable[[dict[str, np.ndarray], int, int], np.ndarray]
    """Stored arrays -> the format's published decode, float32 ``[N, K]``."""
    source: dict[str, Any]
    expects: Callable[[int, int], dict[str, Expect]]
    """``(N, K)`` -> each part's safetensors dtypes and shape (``QuantDir.check_headers``)."""


class Format(ABC):
    """What a reader of one method provides (``prequant_formats``): the layer of a module
    (``None``: the module is not quantized), given its name and whether the checkpoint holds
    ``{module}.{suffix}`` for a suffix."""

    method: str = ""

    @abstractmethod
    def layer(self, module: str, has: Callable[[str], bool]) -> Layer | None: ...

    @abstractmethod
    def describe(self) -> str: ...


class PrequantError(CheckpointError):
    """A pre-quantized checkpoint that cannot be read as stored."""


def as_numpy(f: SafetensorsFile, name: str) -> np.ndarray:
    """One tensor as numpy (BF16 as float32, widened exactly; the raw bits stay in the file)."""
    arr = np.asarray(f.array(name))
    if f.tensors[name].dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def as_torch(f: SafetensorsFile, name: str) -> torch.Tensor:
    """One tensor as torch in its stored dtype (BF16 kept)."""
    arr = np.array(f.array(name), copy=True)
    if f.tensors[name].dtype == "BF16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


class FormatDecodes(Mapping[str, torch.Tensor]):
    """Each quantized weight's format decode (``Layer.reference``), computed from the stored tensors
    when it is read and not kept (the last two, for row-block readers): a whole model in float32 is
    never held. Weight name -> (module, layer, N, K)."""

    def __init__(self, source: QuantDir) -> None:
        self.source = source
        self.specs: dict[str, tuple[str, Layer, int, int]] = {}
        self.recent: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()

    def __getitem__(self, name: str) -> torch.Tensor:
        with self.lock:
            hit = self.recent.get(name)
        if hit is not None:
            return hit
        value = torch.from_numpy(self.decode(name))
        with self.lock:
            self.recent[name] = value
            while len(self.recent) > 2:
                del self.recent[next(iter(self.recent))]
        return value

    def decode(self, name: str) -> np.ndarray:
        """``name``'s format decode, computed from the stored tensors now (not kept)."""
        owner, layer, n, k = self.specs[name]
        return layer.reference(self.source.arrays(owner, layer), n, k)

    def __contains__(self, name: object) -> bool:
        return name in self.specs  # ``Mapping``'s own would compute the decode to answer

    def derived(self, name: str) -> BlobRef:
        """``name``'s decode as a blob-store recipe (``blobs.derived``): hashed once here, made
        again when read, never written to the spill (8B float32 decodes would be 32 GB of it)."""
        value = self[name].numpy()
        ref, _ = hashed(value, DTYPES["f32"])
        derived(ref, lambda: self[name].numpy())
        return ref

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


class QuantDir(Filler):
    """Fills a model from a pre-quantized directory (see the module docstring)."""

    kind = "checkpoint"

    def __init__(
        self, root: Path, fmt: Format, model: nn.Module, mode: FakeTensorMode | None = None, work: Work | None = None
    ) -> None:
        super().__init__(model, mode, work)
        self.root, self.fmt = root, fmt
        self.opening = threading.Lock()
        self.inventory: dict[str, Declared] = checkpoint_inventory(root)
        self.files: dict[str, SafetensorsFile] = {}
        self.layers: dict[str, Layer] = {}
        self.effective = FormatDecodes(self)
        linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        for name in sorted(linears):
            layer = fmt.layer(name, functools.partial(self.declares, name))
            if layer is not None:
                self.layers[name] = layer

    def arrays(self, owner: str, layer: Layer) -> dict[str, np.ndarray]:
        """One layer's stored parts, as read-only maps of the files."""
        return {p: as_numpy(self.file(f"{owner}.{p}"), f"{owner}.{p}") for p in layer.parts}

    def declares(self, module: str, suffix: str) -> bool:
        return f"{module}.{suffix}" in self.inventory

    def file(self, tensor: str) -> SafetensorsFile:
        d = self.inventory[tensor]
        with self.opening:  # once per shard, whichever worker asks first
            if d.file not in self.files:
                fh, _ = open_in(self.root, d.file, SOURCE, field="shard")
                self.files[d.file] = open_file(resolved(self.root, d.file), fh=fh)
            return self.files[d.file]

    def placeholders(self) -> dict[str, BlobRef]:
        """The buffers' placeholders, and each layer's decode's (``<weight>.effective``, float32)."""
        out = super().placeholders()
        for names, _src in self.deferred:
            _, _, n, k = self.effective.specs[names[0]]  # ``quantized`` names every layer it translated
            out[f"{names[0]}.effective"] = placeholder(f"{names[0]}.effective", "f32", (n, k))
        return out

    def held_apart(
        self, hf: str, src: str, mod: nn.Module, made: nn.Module
    ) -> tuple[dict[str, BlobRef], dict[str, np.ndarray]]:
        """The buffers stored as for any source, and the layer's format decode made once, here: hashed
        as the op's ``effective`` operand (``<hf>.effective``; a recipe, made again only if read) and
        handed with the buffers to the compile's per-layer hook (``Work.prequantized``), which proves
        and packs the layer while its decode is in memory."""
        refs, arrays = super().held_apart(hf, src, mod, made)
        values = self.effective.decode(hf)
        ref, pending = hashed(values, DTYPES["f32"])
        if spill_active():
            derived(ref, lambda: self.effective.decode(hf))
        elif pending is not None:
            keep_bytes(ref.sha256, pending)
        self.lazy[f"{hf}.effective"] = ref
        if self.work.prequantized is not None:
            self.work.prequantized(hf, made, refs, arrays, ref, values)
        return refs, arrays

    def fail(self, where: str, field: str, message: str, expected: str = "", found: object = "") -> PrequantError:
        d = self.inventory.get(where)
        file = str(self.root / d.file) if d is not None else str(self.root)
        return PrequantError(message, file=file, tensor=where, field=field, expected=expected, found=str(found))

    def tensor_of(self, hf: str) -> str:
        owner, _, leaf = hf.rpartition(".")
        layer = self.layers.get(owner)
        return f"{owner}.{layer.main}" if layer is not None and leaf == "weight" else hf

    def shape_of(self, src: str) -> tuple[int, ...]:
        return tuple(self.inventory[src].shape)

    def is_dense(self, src: str) -> bool:
        owner, _, leaf = src.rpartition(".")
        layer = self.layers.get(owner)
        return layer is None or leaf != layer.main

    def check_inventory(self) -> None:
        consumed: set[str] = set()
        for names in self.owners.values():
            src = self.tensor_of(names[0])
            if src not in self.inventory:
                raise self.fail(src, "tensor", f"missing (transformers {names[0]} needs it)", "present", "absent")
            consumed.add(src)
        for owner, layer in self.layers.items():
            for part in layer.parts:
                if f"{owner}.{part}" not in self.inventory:
                    raise self.fail(f"{owner}.{part}", "tensor", f"missing ({self.fmt.method} layer {owner})")
                consumed.add(f"{owner}.{part}")
        for name in sorted(set(self.inventory) - consumed):
            raise self.fail(name, "tensor", f"no parameter of this model takes it ({self.fmt.describe()})", "", name)
        self.check_headers()

    def check_headers(self) -> None:
        """Every quantized layer's parts against the dtypes and shapes its format expects for the
        module's (out, in), from the safetensors headers alone: a broken checkpoint is refused,
        naming file, tensor and field, before any tensor's bytes are read."""
        for owner, layer in self.layers.items():
            mod = self.model.get_submodule(owner)
            if not isinstance(mod, nn.Linear):  # QuantDir makes layers of Linears only
                continue
            try:
                want = layer.expects(int(mod.out_features), int(mod.in_features))
            except ValueError as e:  # LayoutError: no layout of this width or shape
                raise self.layout_fail(owner, layer, e) from None
            for part in layer.parts:
                name, spec, d = f"{owner}.{part}", want[part], self.inventory[f"{owner}.{part}"]
                if d.dtype not in spec.dtypes:
                    raise self.fail(
                        name, "dtype", f"not the layout's ({spec.layout})", " or ".join(spec.dtypes), d.dtype
                    )
                if tuple(d.shape) != spec.shape:
                    raise self.fail(
                        name, "shape", f"does not fit the layer ({spec.layout})", str(list(spec.shape)), list(d.shape)
                    )

    def layout_fail(self, owner: str, layer: Layer, e: ValueError) -> PrequantError:
        """A format's ``LayoutError`` (its ``tensor`` a suffix), or any other ``ValueError`` of its
        unpacking, as this checkpoint's typed error."""
        if isinstance(e, LayoutError):
            return self.fail(f"{owner}.{e.tensor}", e.field, e.message, str(e.expected), e.found)
        return self.fail(f"{owner}.{layer.main}", "", str(e))

    def reference(self, hf: str, src: str) -> BlobRef:
        f, d = self.file(src), self.inventory[src]
        if d.dtype not in ("F32", "F16", "BF16"):
            raise self.fail(src, "dtype", "a dense parameter must be float", "F32, F16 or BF16", d.dtype)
        ref, _ = hashed(np.asarray(f.array(src)), DTYPES[ST_IR[d.dtype]])  # the file's map, not a second read
        return dataclasses.replace(ref, location=f"safetensors:{d.file}#{src}")

    def dense(self, hf: str, src: str) -> torch.Tensor:
        self.lazy[src] = self.reference(hf, src)
        return torch.from_numpy(np.array(as_numpy(self.file(src), src), dtype=np.float32))

    def quantized(self, hf: str, src: str, mod: nn.Module) -> nn.Module:
        owner = hf.rpartition(".")[0]
        layer = self.layers[owner]
        if not isinstance(mod, nn.Linear):
            raise self.fail(src, "type", f"{self.fmt.method} codes for a module that is not a Linear", "Linear")
        n, k = int(mod.out_features), int(mod.in_features)
        arrays = self.arrays(owner, layer)
        try:
            aff = layer.translate(arrays, n, k)
            self.effective.specs[hf] = (owner, layer, n, k)
        except ValueError as e:  # LayoutError, which every format raises
            raise self.layout_fail(owner, layer, e) from None
        scale_name = f"{owner}.{layer.scale}"
        scale = as_torch(self.file(scale_name), scale_name)
        scale = scale.T.contiguous() if layer.transposed else scale
        if aff.get("family") == "f8e4m3":
            codes8 = torch.from_numpy(np.array(aff["codes"], dtype=np.uint8))
            return Float8Linear(codes8, scale, aff["group"], mod.bias, torch.float32, dict(layer.source))
        zero = None if aff["zero"] is None else torch.from_numpy(aff["zero"])
        codes = torch.from_numpy(np.array(aff["codes"], dtype=np.int8))
        g_idx = None if aff.get("g_idx") is None else torch.from_numpy(aff["g_idx"])
        q = AffineQuant(codes, scale, zero, aff["qmin"], aff["qmax"], aff["group"], g_idx)
        return QuantLinear(q, mod.bias, torch.float32, dict(layer.source))


def carried_files(root: Path) -> dict[str, bytes]:
    return {n: read_bounded(root, n, MAX_CARRIED_BYTES, SOURCE) for n in TOKENIZER_FILES if (root / n).is_file()}


def load_prequantized(spec: str, fmt: Format, work: Work | None = None) -> Capturable:
    """``spec`` (a pre-quantized HF directory read by ``fmt``) as a ``Capturable`` with its
    ``SourceInfo``, checkpoint state, dense tensors' source references and effective weights."""
    root = Path(spec)
    config = read_config(root, quantized=True)
    float_config = {k: v for k, v in config.items() if k != "quantization_config"}
    arch = str((config.get("architectures") or [""])[0])
    causal = arch.endswith("ForCausalLM") or not arch
    with quiet_transformers():  # parameters fake: streamed, weight by weight (``rebuilt.Filler``)
        model, mode = fake_model(lambda: float_model(float_config, causal))
        buffers = real_buffers(lambda: float_model(float_config, causal))
    filler = QuantDir(root, fmt, model, mode, work)
    if not filler.layers:
        raise PrequantError(
            f"{fmt.describe()}, but no Linear of this model has its quantized tensors",
            file=str(root),
            field="tensors",
            expected="e.g. model.layers.0.self_attn.q_proj."
            + ("qweight" if fmt.method != "compressed-tensors" else "weight_packed"),
            found="none",
        )
    filler.run()
    cap = wrap_hf(model, root.name)
    cap.provenance.update({"source_format": fmt.describe(), "source_dir": root.name})
    acts = {o: str(la.source["activations"]) for o, la in sorted(filler.layers.items()) if la.source.get("activations")}
    if acts:  # recorded, not applied: the graph computes activations in float (module_attrs.activation_schemes)
        cap.provenance["activation_schemes"] = json.dumps(acts, sort_keys=True)
    weights = {n: sha256_in(root, n, SOURCE) for n in sorted({d.file for d in filler.inventory.values()})}
    cap.source = SourceInfo(
        spec, float_config, carried_files(root), digests_sha256(weights) or "", "unversioned local directory"
    )
    cap.source.metadata["quantization_config_sha256"] = canonical_sha256(config.get("quantization_config"))
    cap.state = imported_state(model, (QuantLinear, QuantEmbedding, Float8Linear))
    cap.effective = filler.effective
    cap.lazy = filler.lazy
    cap.buffers = buffers
    cap.base_dir = str(root.resolve())
    if filler.deferred:
        cap.reading = Reading(filler.placeholders(), filler.pending)
    return cap
