"""The pass manager: validates a pipeline before anything runs, then runs it with instrumentation.

Instrumentation lives in one place, called after every pass: verify (on by default), print IR
(after all / after named passes / after a change), dump numbered re-parseable files whose header
names the remaining pipeline, and time each pass.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from qcompiler.errors import PassError, PassNotImplementedError, PipelineError, QcError, VerifyError
from qcompiler.interrupt import check
from qcompiler.ir.core import Module
from qcompiler.ir.invariants import INVARIANTS
from qcompiler.ir.printer import print_module
from qcompiler.ir.relocate import relocate_to_files
from qcompiler.ir.verifier import verify_module
from qcompiler.passes import get_pass_class, pass_names
from qcompiler.passes.base import Pass, PassContext
from qcompiler.passes.spec import format_pipeline

REMAINING_HEADER = "// remaining-pipeline: "


@dataclass
class Instrumentation:
    """What happens between passes. Defaults: verify after each pass, print nothing."""

    verify_each: bool = True
    verify_data: bool = False
    print_after_all: bool = False
    print_after: frozenset[str] = frozenset()
    print_after_change: bool = False
    track_changes: bool = False
    """Fingerprint the IR around each pass (implied by ``print_after_change``; used by timing)."""
    dump_dir: Path | None = None
    stream: TextIO = field(default_factory=lambda: sys.stderr)


@dataclass(frozen=True)
class PassTiming:
    name: str
    seconds: float
    verify_seconds: float
    changed: bool


def fingerprint(m: Module) -> str:
    return hashlib.sha256(print_module(m).encode()).hexdigest()


def establishers(invariant: str) -> list[str]:
    """Names of the registered passes that establish ``invariant``."""
    out: list[str] = []
    for name in pass_names():
        cls = get_pass_class(name)
        if cls is not None and invariant in cls.establishes:
            out.append(name)
    return out


def invariant_order(name: str) -> int:
    """Position of an invariant in the default pipeline (the order passes establish them)."""
    order = list(INVARIANTS)
    return order.index(name) if name in order else len(order)


def validate_pipeline(passes: list[Pass], start: set[str]) -> None:
    """Reject the pipeline, before any pass runs, if a pass lacks an invariant it requires (checked
    first, for the whole pipeline) or is registered but not implemented yet."""
    held = set(start)
    for i, p in enumerate(passes, start=1):
        missing = sorted(p.requires - held, key=invariant_order)
        if missing:
            by = establishers(missing[0])
            hint = f"; run {' or '.join(repr(b) for b in by)} before it" if by else ""
            have = ", ".join(sorted(held, key=invariant_order)) or "none"
            need = ", ".join(f"'{n}'" for n in missing)
            raise PipelineError(
                f"pipeline rejected before any pass ran: pass {i} of {len(passes)} '{p.name}' requires {need}, "
                f"which neither the input nor an earlier pass establishes (held at that point: {have}){hint}"
            )
        held = (held - p.invalidates) | p.establishes
    for i, p in enumerate(passes, start=1):
        if not p.implemented:
            raise PassNotImplementedError(
                f"pipeline rejected before any pass ran: pass {i} of {len(passes)} '{p.name}' is registered "
                "but not implemented yet; it refuses to run rather than pass IR through unchanged"
            )


def record_invariants(module: Module, p: Pass) -> None:
    """Drop what ``p`` invalidates and add what it establishes; leave the attribute alone when
    nothing changes (so a no-op pass leaves the IR byte-identical)."""
    held = [n for n in module.invariants if n not in p.invalidates]
    new = held + sorted(p.establishes - set(held))
    if new != module.invariants:
        module.set_invariants(new)


class PassManager:
    """Runs ``passes`` over a module; see ``Instrumentation`` for what happens between them."""

    def __init__(self, passes: list[Pass], instrument: Instrumentation | None = None) -> None:
        self.passes = passes
        self.instrument = instrument or Instrumentation()
        self.timings: list[PassTiming] = []

    def run(self, module: Module, ctx: PassContext | None = None) -> Module:
        ctx = ctx or PassContext(base_dir=module.base_dir)
        validate_pipeline(self.passes, set(module.invariants))
        history: list[str] = []
        for i, p in enumerate(self.passes):
            check()  # a recorded SIGINT/SIGTERM (qcompiler/interrupt.py)
            track = self.instrument.print_after_change or self.instrument.track_changes
            before = fingerprint(module) if track else ""
            t0 = time.perf_counter()
            module = self.run_one(p, module, ctx, history)
            t1 = time.perf_counter()
            record_invariants(module, p)
            if self.instrument.verify_each:
                self.verify(p, module, history)
            t2 = time.perf_counter()
            changed = self.after_pass(i, p, module, before)
            self.timings.append(PassTiming(p.name, t1 - t0, t2 - t1, changed))
            history.append(p.name)
        return module

    def run_one(self, p: Pass, module: Module, ctx: PassContext, history: list[str]) -> Module:
        after = f" (after: {', '.join(history)})" if history else " (first pass)"
        try:
            return p.run(module, ctx)
        except QcError as e:
            raise PassError(f"pass '{p.name}' failed{after}: {e}") from e
        except Exception as e:  # a bug in the pass: still a typed, located error
            raise PassError(f"internal error in pass '{p.name}'{after}: {type(e).__name__}: {e}") from e

    def verify(self, p: Pass, module: Module, history: list[str]) -> None:
        try:
            verify_module(module, data=self.instrument.verify_data)
        except VerifyError as e:
            raise PassError(f"IR after pass '{p.name}' does not verify: {e}") from e

    def after_pass(self, i: int, p: Pass, module: Module, before: str) -> bool:
        ins = self.instrument
        changed = bool(before) and fingerprint(module) != before
        if ins.print_after_all or p.name in ins.print_after or (ins.print_after_change and changed):
            ins.stream.write(f"// -----// IR Dump After {p.name} (pass {i + 1} of {len(self.passes)}) //----- //\n")
            ins.stream.write(print_module(module))
        if ins.dump_dir is not None:
            self.dump(i, p, module)
        return changed

    def dump(self, i: int, p: Pass, module: Module) -> None:
        assert self.instrument.dump_dir is not None
        d = self.instrument.dump_dir
        d.mkdir(parents=True, exist_ok=True)
        remaining = format_pipeline(self.passes[i + 1 :])
        header = [
            f"// qcompiler IR after pass {i + 1} of {len(self.passes)}: {p.name}",
            f"// pipeline: {format_pipeline(self.passes)}",
            f"{REMAINING_HEADER}{remaining}".rstrip(),
        ]
        text = "\n".join(header) + "\n" + print_module(relocate_to_files(module, d))
        (d / f"{i:02d}_{p.name}.qir").write_text(text)


DUMP_HEADER_PREFIXES = ("// qcompiler IR after pass ", "// pipeline: ", REMAINING_HEADER.rstrip())


def strip_dump_header(module: Module) -> None:
    """Drop a dump file's header lines (they describe a pipeline position the module has left)."""
    module.comments = [c for c in module.comments if not c.startswith(DUMP_HEADER_PREFIXES)]


def remaining_pipeline(module: Module) -> str | None:
    """The remaining-pipeline spec recorded in a dump file's header, if there is one."""
    prefix = REMAINING_HEADER.rstrip()
    for line in module.comments:
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    return None


__all__ = [
    "Instrumentation",
    "PassManager",
    "PassNotImplementedError",
    "PipelineError",
    "remaining_pipeline",
    "validate_pipeline",
]
