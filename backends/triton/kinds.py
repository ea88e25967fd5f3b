"""The kinds of generated kernel the ``triton`` target emits, as one table: ``KINDS``.

A kind is a key type (what one generated module is specialised on) and everything the target does
with a key of that type, so emit, the reader, the runtime and ``verify`` look the kind up instead of
branching on it:

| field | ``affine`` (``KernelKey``) | ``mixprec`` (``MixKey``) |
|---|---|---|
| ``rules`` | the key's JSON fields, types, allowed values (the reader) | same |
| ``layout`` | ``triton-kn`` (the codes as stored) | ``mixprec`` (``planes-a16``) |
| ``generate`` | ``codegen.generate`` | ``mixprec_codegen.generate_mixprec`` |
| ``functions`` | each kernel's parameters and launch configuration | same |
| ``admission`` | ``runtime.admission_json`` | ``mixprec_runtime.admission_json`` |
| ``compile`` | ``aot.compile_key`` (sm_80, sm_90) | ``mixprec_run.compile_mixprec`` |
| ``specs`` | ``runtime.specs`` (registered ``KernelSpec``s) | ``mixprec_runtime.specs`` |
| ``parity`` | interpreter parity on one stored weight | same |

``kernels/index.json`` names each entry's ``kind``; the reader parses the key by the kind's rules and
regenerates the source with the kind's ``generate``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qcompiler.backends.triton import codegen, mixprec_codegen, mixprec_runtime, runtime
from qcompiler.backends.triton.aot import SHARED_LIMIT, compile_key
from qcompiler.backends.triton.codegen import BITS, TL_DTYPE, KernelKey
from qcompiler.backends.triton.mixprec_codegen import MixKey
from qcompiler.backends.triton.mixprec_run import compile_mixprec
from qcompiler.backends.triton.parity import INTERPRET, KernelParity, kernel_parity
from qcompiler.ir.blobs import read_array
from qcompiler.ir.core import Module, Op
from qcompiler.ir.types import QuantType
from qcompiler.parity import decoded
from qcompiler.runtime.kernels import KernelSpec, Place
from qcompiler.runtime.load import resolve_place

Rules = dict[str, tuple[type, tuple[Any, ...] | None]]


@dataclass(frozen=True)
class KernelKind:
    """One kind of generated kernel module (see the module docstring)."""

    name: str
    key_type: type
    rules: Rules
    """Each key field: its JSON type and (if limited) its allowed values."""
    optional: Rules
    """Fields a key holds only when set (``KernelKey.as_dict`` leaves ``float8: false`` out)."""
    version: int
    """The codegen version (part of every generated source's text)."""
    layout: str
    generate: Callable[[Any], str]
    functions: Callable[[Any], dict[str, dict[str, Any]]]
    admission: Callable[[Any], dict[str, Any]]
    compile: Callable[[Any], dict[str, Any]]
    specs: Callable[[Any], list[KernelSpec]]
    parity: Callable[[Module, Op, QuantType, Any, str | None], list[KernelParity]]
    """Interpreter parity (device ``None``) or on a CUDA device (``"cuda"``), on one stored weight."""
    dtypes: Callable[[Any], tuple[str, ...]]
    """The key's value dtypes (activations, scales, outputs): the interpreter cannot run bf16."""


def place_of(device: str | None) -> Place:
    return INTERPRET if device is None else resolve_place(device)


def affine_parity(m: Module, w: Op, t: QuantType, key: KernelKey, device: str | None) -> list[KernelParity]:
    slots = [s for s in ("codes", "scale", "zero", "perm") if s in w.attrs]
    arrays = {s: read_array(m, str(w.attrs[s]).removeprefix("@")) for s in slots}
    codes, scale, zero, perm = arrays["codes"], arrays["scale"], arrays.get("zero"), arrays.get("perm")
    return kernel_parity(key, codes, scale, zero, perm, decoded(m, w, t), place=place_of(device))


def mixprec_functions(key: MixKey) -> dict[str, dict[str, Any]]:
    """As ``codegen.functions``: each kernel's parameters (name, AOT type) and launch configuration."""
    return {
        fn: {"params": [list(p) for p in mixprec_codegen.params(key, fn)], "launch": cfg}
        for fn, cfg in mixprec_codegen.launch(key).items()
    }


def mixprec_compile(key: MixKey) -> dict[str, Any]:
    """``compile_mixprec``, refusing a binary past a target's shared memory (as ``aot.compile_key`` does)."""
    evidence = compile_mixprec(key)
    for target, binaries in evidence["targets"].items():
        limit = SHARED_LIMIT[int(target.removeprefix("sm_"))]
        for name, b in binaries.items():
            if b["shared_bytes"] > limit:
                raise ValueError(
                    f"{key.id} {name}: {b['shared_bytes']} bytes of shared memory exceed {target}'s {limit}"
                )
    return evidence


def mixprec_parity(m: Module, w: Op, t: QuantType, key: MixKey, device: str | None) -> list[KernelParity]:
    return mixprec_runtime.parity(m, w, t, key, place=place_of(device))


DTYPES = tuple(TL_DTYPE)
KINDS: dict[str, KernelKind] = {
    "affine": KernelKind(
        name="affine",
        key_type=KernelKey,
        rules={
            "op": (str, ("linear", "embedding")),
            "bits": (int, BITS),
            "signed": (bool, None),
            "group": (int, None),
            "zero": (bool, None),
            "perm": (bool, None),
            "act": (str, DTYPES),
            "scale": (str, DTYPES),
            "out": (str, DTYPES),
            "bias": (bool, None),
        },
        optional={"float8": (bool, (True,))},
        version=codegen.CODEGEN_VERSION,
        layout="triton-kn",
        generate=codegen.generate,
        functions=codegen.functions,
        admission=runtime.admission_json,
        compile=compile_key,
        specs=runtime.specs,
        parity=affine_parity,
        dtypes=lambda key: (key.act, key.scale, key.out),
    ),
    "mixprec": KernelKind(
        name="mixprec",
        key_type=MixKey,
        rules={
            "act": (str, DTYPES),
            "out": (str, DTYPES),
            "group": (int, None),
            "group2": (int, None),
            "bias": (bool, None),
            "outliers": (bool, None),
        },
        optional={},
        version=mixprec_codegen.MIXPREC_CODEGEN_VERSION,
        layout="mixprec",
        generate=mixprec_codegen.generate_mixprec,
        functions=mixprec_functions,
        admission=mixprec_runtime.admission_json,
        compile=mixprec_compile,
        specs=mixprec_runtime.specs,
        parity=mixprec_parity,
        dtypes=lambda key: (key.act, key.out),
    ),
}
"""Kind name -> the kind, as ``kernels/index.json`` names it."""


def kind_of(key: object) -> KernelKind:
    """The kind of a kernel key, by its type."""
    kind = next((k for k in KINDS.values() if type(key) is k.key_type), None)
    if kind is None:
        raise TypeError(f"no kernel kind has keys of type {type(key).__name__}")
    return kind


def interpretable(key: object) -> bool:
    """Whether Triton's CPU interpreter runs the key's kernels (its bf16 arithmetic works on raw bits)."""
    return "bf16" not in kind_of(key).dtypes(key)
