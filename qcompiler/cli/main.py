"""Entry point: ``qcompiler <command> ...``. Subcommands are a table, each a module with
``add_arguments(parser)`` and ``run(args) -> int``. Typed errors print as one message, exit 1."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import logging
import os
import signal
import sys
from types import ModuleType

from qcompiler import __version__
from qcompiler.cli.quiet import internal_error, quiet
from qcompiler.env import QC_DEBUG
from qcompiler.errors import QcError
from qcompiler.heap import reuse_small_buffers
from qcompiler.interrupt import stopped_by_signals

COMMANDS: dict[str, tuple[str, str]] = {
    "compile": ("qcompiler.cli.compile", "compile a model (HF directory or pkg.module:factory) into an artifact"),
    "inspect": ("qcompiler.cli.inspect", "show what an artifact holds (after every reader gate) [--json]"),
    "verify": ("qcompiler.cli.verify", "reopen an artifact through every gate and re-run its parity rungs [--json]"),
    "sign": ("qcompiler.cli.sign", "sign an artifact that verifies: manifest.sig, Ed25519 over manifest.json [--json]"),
    "keygen": ("qcompiler.cli.sign", "make an Ed25519 key pair for sign / verify --trusted-key"),
    "run": ("qcompiler.cli.run", "load an artifact with the CPU kernels, run it, decode greedily [--trace] [--json]"),
    "opt": ("qcompiler.cli.opt", "parse textual IR, run a pass pipeline, print the result"),
    "demo": ("qcompiler.cli.demo", "build the built-in example model and show its IR"),
    "clean": ("qcompiler.cli.clean", "remove what interrupted compiles left beside the artifacts in DIR [--dry-run]"),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, ModuleType]]:
    parser = argparse.ArgumentParser(prog="qcompiler", description="Compile quantized models into verified artifacts.")
    parser.add_argument("--version", action="version", version=f"qcompiler {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules: dict[str, ModuleType] = {}
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip())
        module.add_arguments(p)
        modules[name] = module
    return parser, modules


def main(argv: list[str] | None = None, *, then: signal.Handlers | None = None) -> int:
    """Run one command. A typed error prints as one message (exit 1); any other exception is an
    internal error, printed in one paragraph with the command to rerun under ``QC_DEBUG=1`` (exit 2).
    SIGINT and SIGTERM, from the first import of a command on, unwind it (``interrupted``, exit 130;
    ``qcompiler/interrupt.py``); ``then``: the handlers they get afterwards (default: as before)."""
    try:
        with stopped_by_signals(then):
            return dispatch(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def dispatch(argv: list[str] | None) -> int:
    quiet()
    reuse_small_buffers()
    parser, modules = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        return int(modules[args.command].run(args))
    except QcError as e:
        if QC_DEBUG.level() >= 1:
            raise
        text = str(e)
        first = text.split("\n", 1)[0]
        print(text if "error:" in first else f"error: {text}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except Exception as e:
        if QC_DEBUG.level() >= 1:
            raise
        print(internal_error(argv, e), file=sys.stderr)
        return 2


GC_THRESHOLDS = (50_000, 20, 100)
"""``gc.set_threshold`` for a command (``entry``): measured on the 1.1B compile, paired runs, about
8% less CPU time than the default ``(700, 10, 10)`` and the same peak (docs/performance.md)."""


def entry() -> None:
    """The ``qcompiler`` executable: ``main``, then exit, a signal from the end of the command on ignored.

    The exit skips the interpreter's teardown (``os._exit`` once the standard streams and logging are
    flushed): every file the command wrote is closed and every temporary directory removed by then,
    and collecting the objects torch and transformers leave behind took about 1 s after a 1.1B
    compile, for nothing.

    The cyclic garbage collector runs a young collection every ``GC_THRESHOLDS[0]`` allocations (700
    by default) and the others ever more rarely: a command allocates millions of small objects
    (imports, the IR, ``torch.export``'s tracing) and frees its large buffers by reference count,
    and at the default a 1.1B compile spent about 4% of its CPU time in collections (with the
    child's copy-on-write of the pages they touched; ``frontend/forked.py``). Cycles are still
    collected, in fewer, larger batches."""
    gc.set_threshold(*GC_THRESHOLDS)
    code = main(then=signal.SIG_IGN)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe, a closed stream
            stream.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    entry()
