"""The core's kernels, declared in ``KERNELS`` (the registry, ``kernels.registry()``, reads it).

- ``cpu.int4pack`` (packed): affine i4, groups of 32/64/128/256 along K, optional int zero point, N a
  multiple of 16 (its tiles' rows).
  torch's ``_weight_int4pack_mm_for_cpu``; at load the codes are repacked into its ISA-specific
  tiles (``code + 8``), with the zero point in the float domain (``-zero * scale``).
- ``cpu.int8pack`` (packed): affine i8, per channel, symmetric. torch's ``_weight_int8pack_mm``
  on the codes as stored (int8 ``[N, K]``).
- ``cpu.int4pack-bf16`` / ``cpu.int8pack-bf16`` (packed, ``computes="bf16"``): the same tiles and codes with
  bf16 activations, scales (and ``-zero * scale``) rounded to bf16, float32 accumulation inside torch's
  kernel, the output cast back to the graph's dtype: about 25x faster than the float32-activation path at
  M=1 on AVX-512 (see docs/performance.md). Admitted only under ``load(compute="bf16")``; their stated
  bound is ``BF16_BOUND`` (relative L2 against the float64 decode), about 3x the measured 2.8e-3.
- ``cpu.embedding-rows`` (packed, ``q.embedding``): affine, any codes and groups; decodes only the
  gathered rows.
- ``cpu.reference`` (reference): anything the reference decoder reads; a float64 matmul on every
  call (verification only).
- ``cpu.dequant`` / ``cuda.dequant`` (fallback): anything the reference decoder reads; the whole
  weight decoded to a dense float32 buffer at load (on the device for ``cuda``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from qcompiler.ir.blobs import read_array, read_float32
from qcompiler.ir.core import Module, Op
from qcompiler.ir.layouts import logical_view
from qcompiler.ir.types import QuantType
from qcompiler.parity import decoded, needed_parts
from qcompiler.runtime.cpu_mixprec import KERNEL as MIXPREC
from qcompiler.runtime.kernels import KernelSpec, Kind, Place

ANY_FAMILY = frozenset({"affine", "nested", "ternary", "f8e4m3", "codebook", "float", "mixprec"})
FLOATS = frozenset({"f32", "f16", "bf16"})
BF16_BOUND = 8e-3
"""The bf16 kernels' stated error: input, scales and output each rounded to bf16 (2^-9 relative per
element), float32 accumulation; measured 2.6e-3 to 2.8e-3 on seeded inputs."""


PARTS: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]] = {}
"""Unpacked weights of the load in progress (materialisation and the self-check share them); the
loader clears it when it is done."""


def affine_parts(m: Module, op: Op, t: QuantType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Logical codes ``[N, K]``, float32 scale ``[N, G]``, int zero ``[N, G]`` or None, and the group size."""
    key = (id(m), str(op.attrs["codes"]))
    if key not in PARTS:
        PARTS[key] = unpacked(m, op, t)
    return PARTS[key]


def unpacked(m: Module, op: Op, t: QuantType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    p = needed_parts(m, op, t)  # the codes, and the slots their layout needs
    codes, _ = logical_view(p["codes"], t, p)  # type: ignore[arg-type]
    scale = read_float32(m, str(op.attrs["scale"]).removeprefix("@"))  # bf16 bits widened, not cast
    zero_ref = op.attrs.get("zero")
    zero = (
        None if zero_ref is None else torch.from_numpy(read_array(m, str(zero_ref).removeprefix("@")).astype(np.int32))
    )
    group = t.group.size if t.group is not None else int(t.shape[1])
    return torch.from_numpy(codes.astype(np.int32)), torch.from_numpy(scale), zero, group


def flat(x: torch.Tensor, k: int) -> tuple[torch.Tensor, list[int]]:
    return x.reshape(-1, k), list(x.shape[:-1])


def int4_prepare(m: Module, op: Op, t: QuantType, place: Place) -> dict[str, Any]:
    codes, scale, zero, group = affine_parts(m, op, t)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes + 8, 1)
    sz = torch.zeros(scale.shape[1], scale.shape[0], 2, dtype=torch.float32)
    sz[..., 0] = scale.T
    if zero is not None:
        sz[..., 1] = (-zero.float() * scale).T
    return {
        "packed": packed,
        "scale_zero": sz,
        "group": group,
        "k": int(t.shape[1]),
        "n": int(t.shape[0]),
        "act": torch.float32,
    }


def int4_run(h: dict[str, Any], x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``cpu.int4pack`` and ``cpu.int4pack-bf16``: the activations in the handle's ``act`` dtype."""
    x2, lead = flat(x, h["k"])
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(h["act"]), h["packed"], h["group"], h["scale_zero"])
    y = y.reshape([*lead, h["n"]]).to(x.dtype)
    return y if bias is None else y + bias


def int4_bf16_prepare(m: Module, op: Op, t: QuantType, place: Place) -> dict[str, Any]:
    h = int4_prepare(m, op, t, place)
    return {**h, "scale_zero": h["scale_zero"].to(torch.bfloat16), "act": torch.bfloat16}


def int8_prepare(m: Module, op: Op, t: QuantType, place: Place) -> dict[str, Any]:
    codes, scale, _, _ = affine_parts(m, op, t)
    codes = codes.to(torch.int8).contiguous()
    return {"codes": codes, "scale": scale.reshape(-1).contiguous(), "k": int(t.shape[1]), "act": torch.float32}


def int8_run(h: dict[str, Any], x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``cpu.int8pack`` and ``cpu.int8pack-bf16``: the activations in the handle's ``act`` dtype."""
    x2, lead = flat(x, h["k"])
    y = torch.ops.aten._weight_int8pack_mm(x2.to(h["act"]), h["codes"], h["scale"])
    y = y.reshape([*lead, y.shape[-1]]).to(x.dtype)
    return y if bias is None else y + bias


def int8_bf16_prepare(m: Module, op: Op, t: QuantType, place: Place) -> dict[str, Any]:
    h = int8_prepare(m, op, t, place)
    return {**h, "scale": h["scale"].to(torch.bfloat16), "act": torch.bfloat16}


def rows_prepare(m: Module, op: Op, t: QuantType, place: Place) -> dict[str, Any]:
    codes, scale, zero, group = affine_parts(m, op, t)
    return {"codes": codes, "scale": scale, "zero": zero, "group": group, "dtype": torch.float32}


def rows_run(h: dict[str, Any], ids: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    codes, scale = h["codes"][ids], h["scale"][ids]
    k = codes.shape[-1]
    diff = codes if h["zero"] is None else codes - h["zero"][ids].repeat_interleave(h["group"], dim=-1)[..., :k]
    return diff.float() * scale.repeat_interleave(h["group"], dim=-1)[..., :k]


def dense_decode(m: Module, op: Op, t: QuantType) -> torch.Tensor:
    """The weight decoded to float32: vectorised for affine weights with dense qparams (the affine v1
    formula, ``float32(code - zero) * float32(scale)``), else the reference decoder (the slow oracle)."""
    dense_qparams = set(dict(t.qparams)) <= {"scale", "zero"} and not t.perm and not t.exceptions and not t.transforms
    if t.family != "affine" or not dense_qparams or t.decoder != 1:
        return torch.from_numpy(decoded(m, op, t))
    codes, scale, zero, group = affine_parts(m, op, t)
    k = codes.shape[1]
    diff = codes if zero is None else codes - zero.repeat_interleave(group, dim=1)[:, :k]
    return diff.float() * scale.repeat_interleave(group, dim=1)[:, :k]


def dense_prepare(m: Module, op: Op, t: QuantType, place: Place) -> dict[str, Any]:
    return {"weight": dense_decode(m, op, t).to(place.torch_device)}


def dense_run(h: dict[str, Any], x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, h["weight"].to(x.dtype), bias)


def dense_rows(h: dict[str, Any], ids: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.embedding(ids, h["weight"])


def reference_run(h: dict[str, Any], x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ h["weight"].double().T
    return (y if bias is None else y + bias.double()).to(x.dtype)


def decoding(kid: str, op: str, kind: Kind, device: str, run: Any, repack: str = "") -> KernelSpec:
    """A kernel over the whole weight decoded to float32 (reference and fallback): it accepts anything the
    reference decoder reads."""
    return KernelSpec(
        kid,
        op,
        kind,
        device,
        families=ANY_FAMILY,
        codes=frozenset({"i2", "i3", "i4", "i5", "i6", "i8", "u2", "u3", "u4", "u5", "u6", "u8"}),
        zero="any",
        scale_dtypes=FLOATS | {"quantized"},
        groups=None,
        activations=FLOATS,
        outputs=FLOATS,
        perm="any",
        repack=repack,
        prepare=dense_prepare,
        run=run,
    )


def dense_buffer(device: str) -> str:
    return f"the whole weight decoded to a dense float32 buffer on the {device}"


INT4_REPACK = "codes + 8 into torch's ISA-specific int4 tiles; scale and -zero*scale as [K/G, N, 2] "
INT4 = KernelSpec(
    "cpu.int4pack",
    "q.linear",
    "packed",
    "cpu",
    families=frozenset({"affine"}),
    codes=frozenset({"i4"}),
    zero="any",
    scale_dtypes=FLOATS,
    groups=frozenset({32, 64, 128, 256}),
    activations=frozenset({"f32"}),
    outputs=frozenset({"f32"}),
    n_multiple=16,  # torch's int4 tiles hold 16 output rows: a [1, K] or [3, K] weight takes another kernel
    repack=INT4_REPACK + "float32",
    prepare=int4_prepare,
    run=int4_run,
)
INT8 = KernelSpec(
    "cpu.int8pack",
    "q.linear",
    "packed",
    "cpu",
    families=frozenset({"affine"}),
    codes=frozenset({"i8"}),
    zero="none",
    scale_dtypes=FLOATS,
    groups=frozenset({0}),
    activations=frozenset({"f32"}),
    outputs=frozenset({"f32"}),
    repack="",
    prepare=int8_prepare,
    run=int8_run,
)
BF16_IO = frozenset({"f32", "bf16"})

KERNELS = (
    replace(  # declared ahead of the float32 kernels: preferred wherever the load allows bf16
        INT4,
        id="cpu.int4pack-bf16",
        activations=BF16_IO,
        outputs=BF16_IO,
        computes="bf16",
        error_bound=BF16_BOUND,
        repack=INT4_REPACK + "bfloat16",
        prepare=int4_bf16_prepare,
    ),
    replace(
        INT8,
        id="cpu.int8pack-bf16",
        activations=BF16_IO,
        outputs=BF16_IO,
        computes="bf16",
        error_bound=BF16_BOUND,
        repack="scales rounded to bfloat16 (the int8 codes as stored)",
        prepare=int8_bf16_prepare,
    ),
    INT4,
    MIXPREC,
    INT8,
    KernelSpec(
        "cpu.embedding-rows",
        "q.embedding",
        "packed",
        "cpu",
        families=frozenset({"affine"}),
        codes=frozenset({"i2", "i3", "i4", "i5", "i6", "i8"}),
        zero="any",
        scale_dtypes=FLOATS,
        groups=None,
        activations=FLOATS,
        outputs=frozenset({"f32"}),
        epilogues=frozenset(),
        prepare=rows_prepare,
        run=rows_run,
    ),
    decoding("cpu.reference", "q.linear", "reference", "cpu", reference_run),
    decoding("cpu.dequant", "q.linear", "fallback", "cpu", dense_run, dense_buffer("cpu")),
    decoding("cuda.dequant", "q.linear", "fallback", "cuda", dense_run, dense_buffer("cuda")),
    decoding("cpu.reference-embedding", "q.embedding", "reference", "cpu", dense_rows),
    decoding("cpu.dequant-embedding", "q.embedding", "fallback", "cpu", dense_rows, dense_buffer("cpu")),
    decoding("cuda.dequant-embedding", "q.embedding", "fallback", "cuda", dense_rows, dense_buffer("cuda")),
)
"""The core's kernels, in declaration order (the registry sorts them by kind, stably)."""
