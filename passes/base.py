"""The pass contract.

A pass is a frozen dataclass whose fields are its typed options; ``name`` (kebab-case) is the same
string in the CLI, the pipeline spec and its IR test file. It declares the invariants it
``requires`` and ``establishes`` (and any it ``invalidates``), and implements ``run``, which takes a
verified module and returns a module that must verify again::

    @dataclass(frozen=True)
    class PlaceShardsPass(Pass):
        name: ClassVar[str] = "place-shards"
        requires: ClassVar[frozenset[str]] = frozenset({"axes-canonical"})
        establishes: ClassVar[frozenset[str]] = frozenset({"shards-placed"})
        tp: int = 1

        def run(self, module: Module, ctx: PassContext) -> Module: ...

Options map kebab-case in the spec (``max-shard-size``) to snake_case fields (``max_shard_size``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from qcompiler.errors import PassError, PassNotImplementedError
from qcompiler.ir.core import Module
from qcompiler.ir.module_attrs import target_of

if TYPE_CHECKING:
    from qcompiler.artifact.request import ArtifactRequest


@dataclass
class PassContext:
    """What a running pass may consult besides the module: where relative files resolve, a place
    to record statistics (``ctx.stats["dce.removed-ops"] = 3``) shown by ``--time-passes``, and the
    artifact request ``emit-container`` writes."""

    base_dir: str = ""
    stats: dict[str, int] = field(default_factory=dict[str, int])
    artifact: ArtifactRequest | None = None
    """Where ``emit-container`` writes (set by ``qcompiler compile -o``); ``None`` elsewhere."""
    jobs: int = 1
    """Threads a pass may use for independent per-tensor work (``--jobs``); its output is the same for any count."""

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to the statistic ``key``."""
        self.stats[key] = self.stats.get(key, 0) + n


@dataclass(frozen=True)
class Pass:
    """Base class of every pass (see the module docstring)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    requires: ClassVar[frozenset[str]] = frozenset()
    establishes: ClassVar[frozenset[str]] = frozenset()
    invalidates: ClassVar[frozenset[str]] = frozenset()
    implemented: ClassVar[bool] = True
    """False for passes that are registered (so pipelines can name them) but not written yet."""

    def run(self, module: Module, ctx: PassContext) -> Module:
        raise PassNotImplementedError(f"pass '{self.name}' is registered but not implemented yet")

    @classmethod
    def option_fields(cls) -> dict[str, dataclasses.Field[Any]]:
        """Options by spec spelling (kebab-case)."""
        return {f.name.replace("_", "-"): f for f in dataclasses.fields(cls)}

    def spec(self) -> str:
        """This pass as pipeline-spec text; options equal to their default are left out."""
        opts: list[str] = []
        for key, f in self.option_fields().items():
            value = getattr(self, f.name)
            if value != f.default:
                opts.append(f"{key}={format_option(value)}")
        return self.name + ("{" + ",".join(opts) + "}" if opts else "")


def format_option(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ",".join(format_option(v) for v in value) + "]"  # pyright: ignore[reportUnknownVariableType]
    return str(value)


class UnimplementedPass(Pass):
    """Marks a registered pipeline pass whose work lands in a later change. It is refused when a
    pipeline is validated, before anything runs, and ``run`` raises if called directly."""

    implemented: ClassVar[bool] = False


def module_target(m: Module) -> str:
    """The target a pass without ``target=`` works for: the one ``place-shards`` planned for."""
    target = target_of(m)
    if target is None:
        raise PassError("no target: give the pass target=NAME (qcompiler compile --target), or run place-shards first")
    return target
