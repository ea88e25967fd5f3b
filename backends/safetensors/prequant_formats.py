"""The pre-quantized formats ``prequant.py`` reads, one ``Format`` each, and their loaders (the
``PREQUANTIZED`` table of this package, keyed by ``quant_method``).

- ``gptq``: ``quantization_config`` or ``quantize_config.json`` (``bits``, ``group_size``, ``sym``,
  ``desc_act``, ``checkpoint_format`` ``gptq`` = v1 or ``gptq_v2``); ``X.qweight``, ``X.qzeros``,
  ``X.scales``, ``X.g_idx`` per quantized Linear ``X``; 2/3/4/8 bits, sym and asym;
- ``awq``: ``quantization_config`` or ``quant_config.json`` (``bits``/``w_bit``,
  ``group_size``/``q_group_size``, ``zero_point``, ``version``); ``X.qweight``, ``X.qzeros``,
  ``X.scales``; ``gemm``, 4 bits, with zero points;
- ``compressed-tensors``: ``quantization_config`` (``config_groups``, ``ignore``); ``pack-quantized``:
  ``X.weight_packed``, ``X.weight_scale``, ``X.weight_shape``, [``X.weight_zero_point``],
  [``X.weight_g_idx``]; ``int-quantized``/``naive-quantized``: ``X.weight`` (int8),
  ``X.weight_scale``, [``X.weight_zero_point``]; integers of 2-8 bits, channel and group, sym and
  asym, weights only; ``float-quantized``: ``X.weight`` (``F8_E4M3``), ``X.weight_scale`` (per
  tensor ``[1]``, per channel, per group), [an all-zero ``X.weight_zero_point``]: FP8 codes kept as
  their bit patterns (``quant/float8.py``), a dynamic FP8 ``input_activations`` recorded.

Act order (GPTQ ``desc_act``; compressed-tensors ``actorder: "group"``, written before 0.20 with a
``weight_g_idx``) is kept: the layer carries its group index, and each column decodes with its
group's qparams (``gptq_awq.act_order``). Refused, with the field named: a group index whose groups
are not all ``group_size`` columns, GPTQ's marlin and ``gptq_p`` layouts, AWQ ``gemv``,
compressed-tensors' static or integer activation schemes and block-wise scales (``ct_config``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from qcompiler.artifact.reader import parse_json
from qcompiler.backends.safetensors import ct_config, gptq_awq
from qcompiler.backends.safetensors.ct_config import ConfigError, Group, ParsedConfig
from qcompiler.backends.safetensors.gptq_awq import Expect, GptqScheme, LayoutError
from qcompiler.backends.safetensors.layouts import unpack_dim0, unpack_rows, words_per_row
from qcompiler.backends.safetensors.prequant import Format, Layer, PrequantError, load_prequantized
from qcompiler.frontend.hf import Capturable
from qcompiler.frontend.hf_dir import QUANT_CONFIG_FILES, read_config
from qcompiler.frontend.rebuilt import Work
from qcompiler.ir.minifloat import e4m3fn_nan_at
from qcompiler.paths import SOURCE, read_bounded

CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
MAX_QUANT_CONFIG = 1 << 20


def quant_config(root: Path, method: str) -> tuple[dict[str, Any], str]:
    """The method's config object and where it came from (config.json's ``quantization_config``, or
    the repository's own file)."""
    qc = read_config(root, quantized=True).get("quantization_config")
    if isinstance(qc, dict):
        return qc, "config.json: quantization_config"
    for file, m in QUANT_CONFIG_FILES.items():
        if m == method and (root / file).is_file():
            obj = parse_json(read_bounded(root, file, MAX_QUANT_CONFIG, SOURCE), file)
            if isinstance(obj, dict):
                return obj, file
            raise PrequantError("must be a JSON object", file=str(root / file), found=type(obj).__name__)
    raise PrequantError("no quantization config", file=str(root / "config.json"), field="quantization_config")


def field_of(qc: dict[str, Any], where: str, keys: tuple[str, ...], kind: type, default: Any = None) -> Any:
    for key in keys:
        if key in qc:
            value = qc[key]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise PrequantError("wrong type", file=where, field=key, expected=kind.__name__, found=repr(value))
            return value
    if default is None:
        raise PrequantError("missing", file=where, field=keys[0], expected=f"a {kind.__name__}", found="absent")
    return default


class Gptq(Format):
    """GPTQ (v1, v2) and AWQ ``gemm`` checkpoints (``gptq_awq.py``)."""

    def __init__(self, scheme: GptqScheme, where: str) -> None:
        self.scheme, self.where = scheme, where
        self.method = "awq" if scheme.kind == "awq" else "gptq"

    def describe(self) -> str:
        s = self.scheme
        return f"{s.kind} {s.bits}-bit group {s.group} {'sym' if s.sym else 'asym'} ({self.where})"

    def layer(self, module: str, has: Any) -> Layer | None:
        if not has("qweight"):
            return None
        s = self.scheme
        return Layer(
            "qweight",
            s.tensors,
            "scales",
            True,
            functools.partial(gptq_awq.translate, s),
            functools.partial(gptq_awq.reference, s),
            {"kind": s.kind, "bits": s.bits, "group": s.group},
            functools.partial(gptq_awq.expected, s),
        )


def load_gptq(spec: str, work: Work | None = None) -> Capturable:
    root = Path(spec)
    qc, where = quant_config(root, "gptq")
    fmt = str(field_of(qc, where, ("checkpoint_format",), str, "gptq"))
    if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
        raise PrequantError(
            "unsupported GPTQ layout", file=where, field="checkpoint_format", expected="gptq or gptq_v2", found=fmt
        )
    bits = field_of(qc, where, ("bits",), int)
    if bits not in gptq_awq.PACKING:
        widths = ", ".join(map(str, gptq_awq.PACKING))
        raise PrequantError("unsupported code width", file=where, field="bits", expected=widths, found=str(bits))
    scheme = GptqScheme(
        fmt, bits, field_of(qc, where, ("group_size",), int), bool(field_of(qc, where, ("sym",), bool, True))
    )
    return load_prequantized(spec, Gptq(scheme, where), work)


def load_awq(spec: str, work: Work | None = None) -> Capturable:
    root = Path(spec)
    qc, where = quant_config(root, "awq")
    version = str(field_of(qc, where, ("version",), str, "gemm")).lower()
    if version != "gemm":
        raise PrequantError("unsupported AWQ layout", file=where, field="version", expected="gemm", found=version)
    if not field_of(qc, where, ("zero_point",), bool, True):
        raise PrequantError(
            "AWQ without zero points is not read", file=where, field="zero_point", expected="true", found="false"
        )
    bits = field_of(qc, where, ("bits", "w_bit"), int)
    group = field_of(qc, where, ("group_size", "q_group_size"), int)
    return load_prequantized(spec, Gptq(GptqScheme("awq", bits, group, False), where), work)


class Ct(Format):
    """compressed-tensors checkpoints, weight-only integer formats."""

    method = "compressed-tensors"

    def __init__(self, parsed: ParsedConfig) -> None:
        self.parsed = parsed

    def describe(self) -> str:
        formats = sorted({g.format for g in self.parsed.groups})
        return f"compressed-tensors {', '.join(formats)}"

    def layer(self, module: str, has: Any) -> Layer | None:
        g = self.parsed.group_for(module, True)
        if g is None:
            if has("weight_packed") or has("weight_scale"):
                raise PrequantError(
                    "quantized tensors for a module the config leaves dense (ignore or no matching group)",
                    file="config.json",
                    tensor=f"{module}.weight_scale",
                    field="quantization_config",
                )
            return None
        main = main_of(g)
        parts = (main, "weight_scale", *(("weight_shape",) if main == "weight_packed" else ()))
        optional = ("weight_zero_point",) if g.format == "float-quantized" else ("weight_zero_point", "weight_g_idx")
        parts += tuple(p for p in optional if has(p))
        return Layer(
            main,
            parts,
            "weight_scale",
            False,
            functools.partial(ct_translate, g),
            functools.partial(ct_reference, g),
            {"kind": "compressed-tensors", "format": g.format, "bits": g.scheme.num_bits}
            | ({"activations": g.activations} if g.activations else {}),
            functools.partial(ct_expected, g),
        )


def main_of(g: Group) -> str:
    """The suffix of the tensor holding a layer's codes."""
    return "weight_packed" if g.format == "pack-quantized" else "weight"


def ct_group_size(g: Group, k: int) -> int:
    return k if g.scheme.strategy in ("channel", "tensor") else int(g.scheme.group_size or k)


def ct_expected(g: Group, n: int, k: int) -> dict[str, Expect]:
    """Every tensor a compressed-tensors layer of ``N`` outputs and ``K`` inputs may store, as its
    format stores it (the parts a checkpoint leaves out are not checked here)."""
    bits, groups = g.scheme.num_bits, -(-k // ct_group_size(g, k))
    scale = Expect(gptq_awq.FLOATS, (n, groups), f"[out, {groups} groups]")
    if g.format == "float-quantized":
        tensor = g.scheme.strategy == "tensor"
        return {
            "weight": Expect(("F8_E4M3",), (n, k), "F8_E4M3 [out, in]"),
            "weight_scale": Expect(gptq_awq.FLOATS, (1,), "[1] (per tensor)") if tensor else scale,
            "weight_zero_point": Expect(
                (*gptq_awq.FLOATS, "F8_E4M3", "I8"), (1,) if tensor else (n, groups), "zeros shaped like the scale"
            ),
        }
    g_idx = Expect(gptq_awq.INDEX, (k,), "[in]")
    if g.format == "pack-quantized":
        return {
            "weight_packed": Expect(("I32",), (n, words_per_row(k, bits)), f"i32[out, ceil(in*{bits}/32)]"),
            "weight_scale": scale,
            "weight_shape": Expect(gptq_awq.INDEX, (2,), "[out, in]"),
            "weight_zero_point": Expect(
                ("I32",), (words_per_row(n, bits), groups), f"i32[ceil(out*{bits}/32), groups]"
            ),
            "weight_g_idx": g_idx,
        }
    return {
        "weight": Expect(("I8",), (n, k), "i8[out, in]"),
        "weight_scale": scale,
        "weight_zero_point": Expect(("I8", *gptq_awq.INDEX), (n, groups), "[out, groups]"),
        "weight_g_idx": g_idx,
    }


def fp8_translate(g: Group, arrays: dict[str, np.ndarray], n: int, k: int) -> dict[str, Any]:
    """FP8 weights: the ``F8_E4M3`` bytes as uint8 codes, unchanged (no NaN pattern allowed)."""
    codes = np.asarray(arrays["weight"])
    if codes.dtype != np.uint8 or codes.shape != (n, k):
        raise LayoutError("weight", "dtype", "FP8 codes are F8_E4M3 [out, in]", f"F8_E4M3 {[n, k]}", str(codes.dtype))
    at = e4m3fn_nan_at(codes)
    if at is not None:
        raise LayoutError(
            "weight", "value", f"a float8 NaN at {list(at)}", "finite FP8 values", f"0x{int(codes[at]):02x}"
        )
    if "weight_zero_point" in arrays:
        z = np.asarray(arrays["weight_zero_point"])
        if ((z & 0x7F) != 0 if z.dtype == np.uint8 else z != 0).any():
            raise LayoutError("weight_zero_point", "value", "FP8 weights are symmetric", "all zero", "non-zero")
    size = ct_group_size(g, k)
    return {"codes": codes, "zero": None, "qmin": 0, "qmax": 255, "group": size, "g_idx": None, "family": "f8e4m3"}


def fp8_reference(g: Group, arrays: dict[str, np.ndarray], n: int, k: int) -> np.ndarray:
    """``float32(e4m3fn(w)) * float32(s[n, g(k)])``, the element values from torch's own float8 type."""
    import torch

    values = torch.from_numpy(np.array(arrays["weight"], dtype=np.uint8)).view(torch.float8_e4m3fn).float().numpy()
    s = np.asarray(arrays["weight_scale"]).astype(np.float32)
    if g.scheme.strategy == "tensor":
        return np.ascontiguousarray(values * s.reshape(-1)[0])
    return np.ascontiguousarray(values * s[:, np.arange(k) // ct_group_size(g, k)])


def ct_translate(g: Group, arrays: dict[str, np.ndarray], n: int, k: int) -> dict[str, Any]:
    if g.format == "float-quantized":
        return fp8_translate(g, arrays, n, k)
    bits, size = g.scheme.num_bits, ct_group_size(g, k)
    mid, groups = 1 << (bits - 1), -(-k // size)
    if "weight_shape" in arrays and [int(v) for v in arrays["weight_shape"]] != [n, k]:
        raise LayoutError("weight_shape", "value", "disagrees with the model", [n, k], list(arrays["weight_shape"]))
    if g.format == "pack-quantized":
        codes = unpack_rows(np.asarray(arrays["weight_packed"]), bits, n, k)
    else:
        codes = np.asarray(arrays["weight"])
        if codes.dtype != np.int8 or codes.shape != (n, k):
            raise LayoutError(
                "weight",
                "dtype",
                "int-quantized codes must be int8 [out, in]",
                f"I8 {[n, k]}",
                f"{codes.dtype} {list(codes.shape)}",
            )
    if int(codes.min(initial=0)) < -mid or int(codes.max(initial=0)) > mid - 1:
        raise LayoutError(main_of(g), "value", f"a code outside {bits} bits", f"{-mid}..{mid - 1}")
    scale = np.asarray(arrays["weight_scale"])
    gptq_awq.expect_shape("weight_scale", scale, (n, groups), f"[out, {groups} groups]")
    zero = ct_zero(g, arrays, n, groups)
    g_idx = None
    if "weight_g_idx" in arrays:
        g_idx = gptq_awq.act_order("weight_g_idx", ct_g_idx(arrays), size, k)
    return {
        "codes": np.ascontiguousarray(codes, dtype=np.int8),
        "zero": zero,
        "qmin": -mid,
        "qmax": mid - 1,
        "group": size,
        "g_idx": g_idx,
    }


def ct_g_idx(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """``weight_g_idx`` as int64 (the group of each input column); an integer tensor, else a ``LayoutError``."""
    raw = np.asarray(arrays["weight_g_idx"])
    if not np.issubdtype(raw.dtype, np.integer):
        raise LayoutError("weight_g_idx", "dtype", "a group index must be integers", "I32", str(raw.dtype))
    return raw.astype(np.int64)


def ct_zero(g: Group, arrays: dict[str, np.ndarray], n: int, groups: int) -> np.ndarray | None:
    if "weight_zero_point" not in arrays:
        if not g.scheme.symmetric:
            raise LayoutError(
                "weight_zero_point", "tensor", "asymmetric scheme without zero points", "a tensor", "none"
            )
        return None
    raw = np.asarray(arrays["weight_zero_point"])
    zero = unpack_dim0(raw, g.scheme.num_bits, n) if g.format == "pack-quantized" else raw.astype(np.int8)
    gptq_awq.expect_shape("weight_zero_point", zero, (n, groups), f"[out, {groups} groups]")
    if g.scheme.symmetric:
        if (zero != 0).any():
            raise LayoutError(
                "weight_zero_point", "value", "symmetric scheme with a non-zero zero point", 0, "non-zero"
            )
        return None
    return np.ascontiguousarray(zero, dtype=np.int8)


def ct_reference(g: Group, arrays: dict[str, np.ndarray], n: int, k: int) -> np.ndarray:
    """``(q[n, k] - z[n, g(k)]) * s[n, g(k)]`` from the stored tensors (packed codes read field by
    field, not by the layout's tables), with ``g`` the stored ``weight_g_idx`` (act order), else
    ``k // group_size``."""
    if g.format == "float-quantized":
        return fp8_reference(g, arrays, n, k)
    bits, size = g.scheme.num_bits, ct_group_size(g, k)
    mid, gidx = 1 << (bits - 1), ct_g_idx(arrays) if "weight_g_idx" in arrays else None
    col = np.arange(k) // size if gidx is None else gidx
    packed = g.format == "pack-quantized"
    if packed and 32 % bits == 0:
        q = gptq_awq.fields(np.asarray(arrays["weight_packed"]), bits, 1)[:, :k] - mid
    elif packed:
        q = unpack_rows(np.asarray(arrays["weight_packed"]), bits, n, k).astype(np.int32)
    else:
        q = np.asarray(arrays["weight"]).astype(np.int32)
    z: np.ndarray | None = None  # [n, groups]
    if "weight_zero_point" in arrays and not g.scheme.symmetric:
        raw = np.asarray(arrays["weight_zero_point"])
        if packed and 32 % bits == 0:
            z = gptq_awq.fields(raw, bits, 0)[:n] - mid
        else:
            z = (unpack_dim0(raw, bits, n) if packed else raw).astype(np.int32)
    s = np.asarray(arrays["weight_scale"]).astype(np.float32)
    if gidx is None and k % size == 0:  # equal groups in order: broadcast a group's qparams over it
        groups = k // size
        q3 = q.reshape(n, groups, size)
        diff = q3 if z is None else q3 - z[:, :groups, None]
        return np.ascontiguousarray((diff.astype(np.float32) * s[:, :groups, None]).reshape(n, k))
    diff = q if z is None else q - z[:, col]
    return np.ascontiguousarray(diff.astype(np.float32) * s[:, col])


def load_ct(spec: str, work: Work | None = None) -> Capturable:
    root = Path(spec)
    qc, _ = quant_config(root, "compressed-tensors")
    try:
        parsed = ct_config.parse(qc, CT_FORMATS)
    except ConfigError as e:
        raise PrequantError(
            e.message, file=str(root / "config.json"), field=e.field, expected=e.expected, found=str(e.found)
        ) from None
    return load_prequantized(spec, Ct(parsed), work)
