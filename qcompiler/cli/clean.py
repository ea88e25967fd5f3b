"""qcompiler clean DIR [--dry-run] [--json]: remove what interrupted publishes left beside the
artifacts in DIR.

A compile killed while it publishes (SIGKILL, power loss) can leave ``.OUT.tmp-<pid>-<id>`` or
``.OUT.old-<pid>-<id>`` beside its output OUT. For every output in DIR with such leftovers (and for
DIR itself when it is an artifact), clean takes OUT's lock and removes the entries that match that
exact pattern; nothing else is touched. An output that a compile is writing right now is skipped,
its temp directory left alone. Every compile removes its own output's stale leftovers anyway; clean
is for outputs nobody compiles again. --dry-run only lists them (it still takes each lock for a
moment, to tell stale from live); --json prints ``{"dir", "removed", "leftovers": [{"path",
"output", "kind", "pid"}], "busy": [{"output", "message"}]}``. Exit 0, also when some were busy.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from qcompiler.artifact.output import LEFTOVER, OutputBusyError, os_error, remove_leftovers
from qcompiler.artifact.writer import MANIFEST
from qcompiler.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="the directory holding the artifacts (their leftovers sit beside them)")
    p.add_argument("--dry-run", action="store_true", help="list the stale leftovers, remove nothing")
    p.add_argument("--json", action="store_true", help="print the result as JSON on standard output")


def outputs(root: Path) -> list[Path]:
    """The outputs in ``root`` that have entries named like leftovers, and ``root`` if it is an artifact."""
    try:
        names = os.listdir(root)
    except OSError as e:
        raise os_error(e, "listing the directory to clean") from e
    found = [root / name for name in sorted({m["name"] for m in map(LEFTOVER.match, names) if m})]
    return [*found, root] if (root / MANIFEST).is_file() else found


def clean(root: Path, dry_run: bool) -> dict[str, Any]:
    """Remove (or list) the stale leftovers of every output in ``root``; report what and who was busy."""
    leftovers: list[dict[str, Any]] = []
    busy: list[dict[str, str]] = []
    for out in outputs(root):
        try:
            paths = remove_leftovers(out, dry_run=dry_run)
        except OutputBusyError as e:
            busy.append({"output": str(out), "message": str(e)})
            continue
        for path, m in [(p, LEFTOVER.match(p.name)) for p in paths]:
            if m is not None:
                leftovers.append({"path": str(path), "output": str(out), "kind": m["kind"], "pid": int(m["pid"])})
    return {"dir": str(root), "removed": not dry_run, "leftovers": leftovers, "busy": busy}


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if not root.is_dir():
        raise UsageError(f"{root}: not a directory (expected the directory that holds the artifacts)")
    report = clean(root, args.dry_run)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    verb = "removed" if report["removed"] else "would remove"
    for item in report["leftovers"]:
        print(f"{verb} {item['path']} (stale {item['kind']} directory of {item['output']}, left by pid {item['pid']})")
    for item in report["busy"]:
        print(f"skipped {item['output']}: {item['message']}")
    if not report["leftovers"] and not report["busy"]:
        print(f"nothing to clean in {root}")
    return 0
