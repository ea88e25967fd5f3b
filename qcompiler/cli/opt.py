"""qcompiler opt FILE.qir|- [--pipeline SPEC]: parse textual IR, verify it, run a pass pipeline,
print the canonical result.

Without --pipeline, a dump file written by --dump-ir resumes the pipeline its header names;
any other input is printed in canonical form.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from qcompiler.env import QC_DEBUG, QC_DUMP_DIR, QC_VERIFY
from qcompiler.errors import QcError, UsageError, VerifyError
from qcompiler.ir.core import Module
from qcompiler.ir.parser import Chunk, parse_module, split_input
from qcompiler.ir.printer import print_module
from qcompiler.ir.relocate import relocate_to_files
from qcompiler.ir.verifier import verify_module
from qcompiler.passes import get_pass_class, pass_names
from qcompiler.passes.manager import Instrumentation, PassManager, remaining_pipeline, strip_dump_header
from qcompiler.passes.spec import parse_pipeline


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", help="a .qir file, or - for standard input")
    p.add_argument("--pipeline", "-p", help="pass pipeline spec, e.g. 'dce,cse' ('' runs nothing)")
    p.add_argument(
        "-o",
        "--output",
        help="write the result here (tensors made in memory or living elsewhere go to blobs/ beside it)",
    )
    p.add_argument("--no-verify", action="store_true", help="do not run the verifier after each pass")
    p.add_argument(
        "--verify-data", action="store_true", help="also check tensor bytes: sha256, code ranges, permutations"
    )
    p.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass (to stderr)")
    p.add_argument(
        "--print-ir-after", action="append", default=[], metavar="PASS", help="print the IR after PASS (repeatable)"
    )
    p.add_argument("--print-ir-after-change", action="store_true", help="print the IR after each pass that changed it")
    p.add_argument("--dump-ir", metavar="DIR", help="write NN_<pass>.qir after every pass; each file resumes the rest")
    p.add_argument("--time-passes", action="store_true", help="print a per-pass timing table (to stderr)")
    p.add_argument("--keep-comments", action="store_true", help="keep comment and blank lines from the input")
    p.add_argument(
        "--split-input-file", action="store_true", help="treat '// -----' lines as separators of independent inputs"
    )
    p.add_argument(
        "--verify-diagnostics", action="store_true", help="expect every input to fail; print each diagnostic to stdout"
    )
    p.add_argument("--verify-roundtrip", action="store_true", help="check that print(parse(print(m))) == print(m)")
    p.add_argument("--list-passes", action="store_true", help="list registered passes with their invariants and exit")
    p.add_argument("--json", action="store_true", help="with --list-passes: print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    if args.list_passes:
        list_passes(as_json=args.json)
        return 0
    if args.file is None:
        raise UsageError("qcompiler opt: give a .qir file or - for standard input")
    name, text, base_dir = read_input(args.file)
    chunks = split_input(text) if args.split_input_file else [Chunk(text, 1)]
    outputs: list[str] = []
    status = 0
    for chunk in chunks:
        try:
            outputs.append(process(chunk.text, name, chunk.first_line, base_dir, args))
            if args.verify_diagnostics:
                print(
                    f"{name}:{chunk.first_line}: error: expected a diagnostic, but this input verified", file=sys.stderr
                )
                status = 1
        except QcError as e:
            if not args.verify_diagnostics:
                raise
            if QC_DEBUG.level() >= 1:
                raise
            outputs.append(str(e) + "\n")
    write_output("// -----\n".join(outputs), args.output)
    return status


MAX_INPUT_BYTES = 1 << 30
"""Largest textual IR ``opt`` reads (weights live in blobs, so real modules are far smaller)."""


def read_input(path: str) -> tuple[str, str, str]:
    """(name, text, base directory) of the input; a file that is not UTF-8 text is a ``UsageError``
    naming the byte."""
    if path == "-":
        raw, name, base = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1), "<stdin>", "."
    else:
        p = Path(path)
        try:
            with p.open("rb") as f:
                raw = f.read(MAX_INPUT_BYTES + 1)
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror}") from None
        name, base = path, str(p.parent)
    if len(raw) > MAX_INPUT_BYTES:
        raise UsageError(f"{name}: larger than {MAX_INPUT_BYTES} bytes; textual IR keeps weights in blobs")
    try:
        return name, raw.decode("utf-8"), base
    except UnicodeDecodeError as e:
        raise UsageError(f"{name}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def process(text: str, name: str, first_line: int, base_dir: str, args: argparse.Namespace) -> str:
    module = parse_module(text, name, first_line)
    module.base_dir = base_dir
    verify = not args.no_verify and QC_VERIFY.get() != "0"
    if verify:
        verify_module(module, data=args.verify_data)
    spec = args.pipeline if args.pipeline is not None else remaining_pipeline(module)
    if args.pipeline is None and spec is not None:
        strip_dump_header(module)
    if spec:
        module = run_pipeline(module, spec, verify, args)
    if args.output:  # tensors go beside the output so it re-reads with its bytes
        module = relocate_to_files(module, Path(args.output).parent)
    out = print_module(module, keep_comments=args.keep_comments)
    if args.verify_roundtrip:
        again = print_module(parse_module(out, f"{name} (reprinted)"))
        if again != print_module(module):
            raise VerifyError("printing the re-parsed module gives different text", where=name, field="round-trip")
    return out


def run_pipeline(module: Module, spec: str, verify: bool, args: argparse.Namespace) -> Module:
    dump = args.dump_ir or QC_DUMP_DIR.get() or None
    instrument = Instrumentation(
        verify_each=verify,
        verify_data=args.verify_data,
        print_after_all=args.print_ir_after_all or QC_DEBUG.level() >= 2,
        print_after=frozenset(n for item in args.print_ir_after for n in item.split(",")),
        print_after_change=args.print_ir_after_change,
        track_changes=args.time_passes,
        dump_dir=Path(dump) if dump else None,
    )
    manager = PassManager(parse_pipeline(spec), instrument)
    module = manager.run(module)
    if args.time_passes:
        print_timings(manager)
    return module


def print_timings(manager: PassManager) -> None:
    table = Table(title="pass timing")
    for col in ("#", "pass", "run ms", "verify ms", "changed"):
        table.add_column(col, justify="right" if col.endswith("ms") or col == "#" else "left")
    for i, t in enumerate(manager.timings, start=1):
        table.add_row(
            str(i), t.name, f"{t.seconds * 1e3:.2f}", f"{t.verify_seconds * 1e3:.2f}", "yes" if t.changed else ""
        )
    Console(stderr=True).print(table)


def pass_table() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name in pass_names():
        cls = get_pass_class(name)
        assert cls is not None
        rows.append(
            {
                "name": name,
                "summary": cls.summary or (cls.__doc__ or "").strip().splitlines()[0],
                "requires": sorted(cls.requires),
                "establishes": sorted(cls.establishes),
                "invalidates": sorted(cls.invalidates),
                "options": {k: f.default for k, f in cls.option_fields().items()},
                "implemented": cls.implemented,
            }
        )
    return rows


def list_passes(as_json: bool) -> None:
    rows = pass_table()
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="registered passes")
    table.add_column("pass", no_wrap=True)
    for col in ("requires", "establishes", "options", "status"):
        table.add_column(col)
    for r in rows:
        opts = r["options"]
        assert isinstance(opts, dict)
        status = "ready" if r["implemented"] else "not implemented yet"
        requires, establishes = r["requires"], r["establishes"]
        assert isinstance(requires, list)
        assert isinstance(establishes, list)
        table.add_row(
            str(r["name"]),
            ", ".join(map(str, requires)),
            ", ".join(map(str, establishes)),
            ", ".join(f"{k}={v!r}" for k, v in opts.items()),
            status,
        )
    Console(width=max(Console().width, 140)).print(table)


def write_output(text: str, path: str | None) -> None:
    if path is None:
        sys.stdout.write(text)
        return
    Path(path).write_text(text)
