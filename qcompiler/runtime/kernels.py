"""The kernel registry and its admission predicate.

A kernel declares everything it accepts (``KernelSpec``); an op's ``Signature`` is admitted only if
every field matches, and each rejection says which field and why. Kernels are tried in registry
order (``registry()``): packed low-bit kernels first, the full-dequant fallback last. A ``reference``
kernel is never chosen automatically; ``kernels="reference"`` asks for it (verification).

The registry is data: the core's table (``cpu_kernels.KERNELS``) and every backend package's
``KERNELS`` declaration (``qcompiler.plugins``: kernel id -> ``.module:TABLE``), assembled on first
use. ``register`` adds a kernel at run time (an artifact's generated kernels, tests).

| field | the kernel declares | the signature has |
|---|---|---|
| ``op`` | ``q.linear`` or ``q.embedding`` | the op |
| ``device`` / ``min_capability`` | ``cpu`` / ``cuda`` and a compute capability | the load's device |
| ``families`` | representation families (``affine`` ...) | the descriptor's family |
| ``codes`` | code dtypes (``i4``, ``i8``) | the descriptor's code dtype |
| ``zero`` | ``none``, ``int`` or ``any`` | whether a zero point is bound |
| ``scale_dtypes`` | dense scale dtypes | the scale's dtype |
| ``groups`` | accepted group sizes (``0``: per channel, group = K) | the group size along K |
| ``scale_axis`` | the axis groups run along | the descriptor's group axis |
| ``activations`` | activation dtypes | the input's dtype |
| ``computes`` | the dtype it narrows activations to (empty: none) | the narrowest compute the load allows |
| ``outputs`` | output dtypes (accumulation is ``accumulator``) | the result's dtype |
| ``k_multiple`` / ``n_multiple`` | tile multiples | the weight's shape |
| ``epilogues`` | fused epilogues (``bias``) | whether the op has a bias |
| ``phases`` | ``prefill`` / ``decode`` | the phase being planned |
| ``topologies`` | ``tp1`` ... | the artifact's placement |
| ``layouts`` | code layouts read as stored (None: any, unpacked at load) | the weight's layout |
| ``perm`` | ``none``, ``required`` or ``any`` act-order permutation | whether the weight has one |
| ``predicate`` | optional: what the fields cannot say (``None``: admit) | the descriptor, the device's limits |

The ``predicate`` runs only after every field matched (``admit(k, s, t, place)``), on the weight's
descriptor and the place (``Place.limits``: shared memory and registers); a kernel without one is
admitted on the fields alone, exactly as before.

``prepare(module, q.weight op, descriptor, place)`` builds the kernel's resident weight where
``place`` says (``Place``: the device, or Triton's CPU interpreter); kernels with the same ``shares``
id share one prepared weight (a decode and a prefill kernel over the same buffers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch

from qcompiler import plugins
from qcompiler.errors import UsageError
from qcompiler.ir.core import Graph, Op, Value
from qcompiler.ir.ops.quant import Dequantize, QEmbedding, QLinear
from qcompiler.ir.types import DenseType, QuantType

Kind = Literal["packed", "reference", "fallback"]


CPU = torch.device("cpu")


@dataclass(frozen=True)
class DeviceLimits:
    """What one block may use on the device: shared memory (opt-in maximum) and registers."""

    max_shared_bytes: int
    registers_per_thread: int = 255
    registers_per_sm: int = 65536

    def as_dict(self) -> dict[str, int]:
        return {
            "max_shared_bytes": self.max_shared_bytes,
            "registers_per_thread": self.registers_per_thread,
            "registers_per_sm": self.registers_per_sm,
        }


SM80_LIMITS = DeviceLimits(163 * 1024)
"""An Ampere A100's limits: what the interpreter place describes (it stands in for an sm_80 device)."""


@dataclass(frozen=True)
class Place:
    """Where a load's kernels run: the kernel device (``cpu`` / ``cuda``), the torch device holding
    their buffers, whether Triton kernels run on the CPU interpreter, the compute capability and SMs."""

    device: str = "cpu"
    torch_device: torch.device = CPU
    interpret: bool = False
    capability: float = 0.0
    sms: int = 1
    limits: DeviceLimits | None = None
    """The device's per-block limits (``None`` on the CPU: no kernel there asks)."""
    compute: str = "f32"
    """The narrowest activation dtype the load allows a kernel to compute in (``load(compute=...)``):
    ``f32`` admits only kernels that keep the graph's dtype, ``bf16`` also those that round to bf16."""


@dataclass(frozen=True)
class Signature:
    """What one quantized op needs from a kernel."""

    op: str
    name: str
    family: str
    layout: str
    codes: str
    zero: bool
    scale_dtype: str
    group: int
    """The group size along K; 0 when per channel (one group spans K)."""
    scale_axis: int
    activation: str
    output: str
    n: int
    k: int
    bias: bool
    phase: str = "prefill"
    device: str = "cpu"
    capability: float = 0.0
    topology: str = "tp1"
    perm: bool = False
    compute: str = "f32"
    """The narrowest activation dtype the load allows (``Place.compute``)."""

    @property
    def work(self) -> int:
        """Weighted work: multiply-adds per activation row."""
        return self.n * self.k


@dataclass(frozen=True)
class KernelSpec:
    """What a kernel accepts (see the module docstring), and how it is prepared and run."""

    id: str
    op: str
    kind: Kind
    device: str
    families: frozenset[str]
    codes: frozenset[str]
    zero: Literal["none", "int", "any"]
    scale_dtypes: frozenset[str]
    groups: frozenset[int] | None
    activations: frozenset[str]
    outputs: frozenset[str]
    accumulator: str = "f32"
    computes: str = ""
    """The dtype the kernel rounds activations (and its scales) to before the matmul; empty when it computes
    in the activation's own dtype. Admitted only when the load allows that compute (``Signature.compute``),
    and its ``error_bound`` states what the narrowing costs."""
    scale_axis: int = 1
    k_multiple: int = 1
    n_multiple: int = 1
    epilogues: frozenset[str] = frozenset({"bias"})
    phases: frozenset[str] = frozenset({"prefill", "decode"})
    topologies: frozenset[str] = frozenset({"tp1"})
    min_capability: float = 0.0
    layouts: frozenset[str] | None = None
    perm: Literal["none", "required", "any"] = "none"
    needs_bias: bool = False
    """The kernel fuses a bias add it cannot skip (an op without a bias needs another kernel)."""
    shares: str = ""
    repack: str = ""
    """What the kernel does to the stored codes at load time (empty: it reads them as stored)."""
    error_bound: float = 1e-5
    """The relative L2 error against the float64 reference decode that the kernel promises."""
    prepare: Callable[..., Any] | None = None
    run: Callable[..., Any] | None = None
    predicate: Callable[[Signature, QuantType, Place], str | None] | None = None
    """What the fields cannot say, on the descriptor and the place: ``None`` admits, a string is the reason."""


def checks(k: KernelSpec, s: Signature) -> list[tuple[bool, str]]:
    group = "per channel" if s.group == 0 else f"groups of {s.group}"
    return [
        (k.op == s.op, f"runs {k.op}, not {s.op}"),
        (k.device == s.device, f"runs on {k.device}, not {s.device}"),
        (s.capability >= k.min_capability, f"needs capability {k.min_capability}, device has {s.capability}"),
        (s.family in k.families, f"family {s.family} not in {sorted(k.families)}"),
        (s.codes in k.codes, f"codes {s.codes} not in {sorted(k.codes)}"),
        (k.zero == "any" or (k.zero == "none") != s.zero, f"zero point {'present' if s.zero else 'absent'}"),
        (s.scale_dtype in k.scale_dtypes, f"scale {s.scale_dtype} not in {sorted(k.scale_dtypes)}"),
        (k.groups is None or s.group in k.groups, f"{group} not in {sorted(k.groups or ())}"),
        (s.scale_axis == k.scale_axis, f"groups along axis {s.scale_axis}, not {k.scale_axis}"),
        (s.activation in k.activations, f"activation {s.activation} not in {sorted(k.activations)}"),
        (s.output in k.outputs, f"output {s.output} not in {sorted(k.outputs)}"),
        (
            k.computes in ("", s.activation, s.compute),
            f"computes in {k.computes}, narrower than the graph's {s.activation} (compute='{k.computes}' allows it)",
        ),
        (s.k % k.k_multiple == 0 and s.n % k.n_multiple == 0, f"shape [{s.n}, {s.k}] not in tiles"),
        (not s.bias or "bias" in k.epilogues, "no bias epilogue"),
        (s.bias or not k.needs_bias, "fuses a bias and the op has none"),
        (k.layouts is None or s.layout in k.layouts, f"layout {s.layout} not in {sorted(k.layouts or ())}"),
        (
            k.perm == "any" or (k.perm == "required") == s.perm,
            f"act-order permutation {'present' if s.perm else 'absent'}",
        ),
        (s.phase in k.phases, f"phase {s.phase} not in {sorted(k.phases)}"),
        (s.topology in k.topologies, f"topology {s.topology} not in {sorted(k.topologies)}"),
    ]


def admit(k: KernelSpec, s: Signature, t: QuantType | None = None, place: Place | None = None) -> tuple[bool, str]:
    """Whether ``k`` accepts ``s``, and the first reason it does not; then, when every field matched,
    the kernel's ``predicate`` on the descriptor ``t`` and the ``place`` (without them it refuses)."""
    for ok, reason in checks(k, s):
        if not ok:
            return False, reason
    if k.predicate is None:
        return True, "accepted"
    if t is None or place is None:
        return False, "its admission predicate needs the weight's descriptor and the device"
    why = k.predicate(s, t, place)
    return (True, "accepted") if why is None else (False, why)


CORE = "qcompiler.runtime.cpu_kernels:KERNELS"
"""The core's kernel table (the CPU kernels and the fallbacks), ahead of every backend's."""
ORDER: dict[Kind, int] = {"packed": 0, "reference": 1, "fallback": 2}


@functools.cache
def registry() -> list[KernelSpec]:
    """Every kernel, in preference order (packed, then reference, then fallback; declaration order
    within a kind): the core's table, then each backend's ``KERNELS`` declarations, then any
    ``register``-ed since."""
    specs: list[KernelSpec] = []
    for spec in plugins.provide(CORE):
        add(specs, spec)
    for kid, ref in plugins.declared("KERNELS").items():
        add(specs, declared_kernel(kid, ref))
    return specs


def declared_kernel(kid: str, ref: str) -> KernelSpec:
    """The kernel ``kid`` of the table ``ref`` names (``module:TABLE``, or a module: its ``KERNELS``)."""
    provided = plugins.provide(ref)
    table = provided.KERNELS if isinstance(provided, ModuleType) else provided
    spec = next((k for k in table if k.id == kid), None)
    if spec is None:
        raise UsageError(f"KERNELS {kid!r} is declared as {ref}, which holds no kernel {kid!r}")
    return spec


def add(specs: list[KernelSpec], spec: KernelSpec) -> None:
    if any(k.id == spec.id for k in specs):
        raise ValueError(f"kernel {spec.id} registered twice")
    specs.append(spec)
    specs.sort(key=lambda k: ORDER[k.kind])  # stable: declaration order within a kind


def register(spec: KernelSpec) -> KernelSpec:
    """Add ``spec`` to the registry at run time (a kernel no table declares)."""
    add(registry(), spec)
    return spec


def ensure_registered(spec: KernelSpec) -> KernelSpec:
    """``spec``, registered unless a kernel with its id already is (then that one)."""
    return next((k for k in registry() if k.id == spec.id), None) or register(spec)


def weight_ops(g: Graph) -> dict[str, Op]:
    """q.weight result name -> the op."""
    return {op.result.name: op for op in g.ops if op.name == "q.weight"}


def weight_operand(op: Op) -> Value | None:
    """The quantized weight ``op`` reads (``q.linear``, ``q.embedding``, ``q.dequantize``), else ``None``."""
    if isinstance(op, QLinear | QEmbedding):
        return op.w
    return op.x if isinstance(op, Dequantize) else None


def quantized_ops(g: Graph) -> Iterator[tuple[Op, Op, QuantType]]:
    """(consumer op, its q.weight, descriptor) for every op that reads a quantized weight."""
    wops = weight_ops(g)
    for op in g.ops:
        v = weight_operand(op)
        if v is None:
            continue
        w = wops[v.name]
        t = w.result.type
        assert isinstance(t, QuantType)
        yield op, w, t


def signature(op: Op, w: QuantType, phase: str, place: Place) -> Signature:
    y = op.result.type
    x = op.x.type if isinstance(op, QLinear) else y
    assert isinstance(x, DenseType)
    assert isinstance(y, DenseType)
    scale = w.qparam("scale")
    n, k = (int(d) for d in w.shape)
    group = w.group.size if w.group is not None else k
    return Signature(
        op=op.name,
        name=str(v.name) if (v := weight_operand(op)) is not None else "",
        family=w.family,
        layout=f"{w.pack.family}/v{w.pack.version}",
        codes=w.code.dtype.name,
        zero="zero" in dict(w.qparams),
        scale_dtype=scale.dtype.name if isinstance(scale, DenseType) else "quantized",
        group=0 if group == k else group,
        scale_axis=w.group.axis if w.group is not None else 1,
        activation=(x.dtype.name if op.name == "q.linear" else y.dtype.name),
        output=y.dtype.name,
        n=n,
        k=k,
        bias=len(op.operands) > 2,
        phase=phase,
        device=place.device,
        capability=place.capability,
        perm=w.perm is not None,
        compute=place.compute,
    )
