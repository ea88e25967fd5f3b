"""What ``bench/fuzz.py`` reports: outcome counts and cases/s per target, the distinct failures
(untyped exceptions by type and innermost frame, accepted changes by file and field), and the
corpus of failing cases (each the mutated directory plus ``case.json``)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz_classify import FAMILIES

OUTCOMES = ["typed", "accepted-unchanged", "accepted-changed", "untyped", "hang", "memory", "crash", "fuzzer-error"]
FAILING = OUTCOMES[2:]


def case_name(r: dict[str, Any]) -> str:
    return f"{r['target']}-{r['seed']}-{r['index']}"


def copy_safe(src: Path, dest: Path) -> None:
    """Copy a case folder without opening anything but regular files (a FIFO is re-created, links kept)."""
    for dirpath, dirnames, names in os.walk(src):
        here = Path(dirpath)
        out = dest / here.relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for name in names + [d for d in dirnames if (here / d).is_symlink()]:
            p, q = here / name, out / name
            mode = os.lstat(p).st_mode
            if stat.S_ISLNK(mode):
                os.symlink(os.readlink(p), q)
            elif stat.S_ISFIFO(mode):
                os.mkfifo(q)
            elif stat.S_ISREG(mode):
                shutil.copyfile(p, q)


def write_case(corpus: Path, scratch: Path, result: dict[str, Any]) -> Path:
    """``corpus/<target>-<seed>-<index>/``: ``artifact/`` and ``outside/`` as the case left them, and
    ``case.json`` (hard links are copied as plain files; ``--replay`` rebuilds the exact case)."""
    dest = corpus / case_name(result)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    if scratch.is_dir():
        copy_safe(scratch, dest)
    case = {k: v for k, v in result.items() if k != "traceback"}
    case["exception"] = {"type": result.get("exc_type", ""), "message": result.get("error", "")}
    case["traceback"] = str(result.get("traceback", ""))[-20_000:]
    case["replay"] = f"python bench/fuzz.py --replay {result['target']}:{result['seed']}:{result['index']}"
    (dest / "case.json").write_text(json.dumps(case, indent=2) + "\n")
    return dest


copy_case = write_case


def failure_key(r: dict[str, Any]) -> tuple[str, ...]:
    """What makes two failing cases the same finding."""
    outcome = r["outcome"]
    if outcome == "untyped":
        return (outcome, r.get("exc_type", ""), r.get("inner", ""))
    if outcome == "accepted-changed":
        return (outcome, r["target"], r.get("family", ""), r.get("where", ""))
    return (outcome, r["target"], r.get("family", ""), r.get("where", ""))


def seconds_by(rs: list[dict[str, Any]], key: str) -> dict[str, dict[str, float]]:
    """Cases and mean seconds per value of ``key``."""
    groups: dict[str, list[float]] = {}
    for r in rs:
        groups.setdefault(str(r.get(key, "")), []).append(float(r.get("seconds", 0)))
    return {k: {"cases": len(v), "mean_s": round(sum(v) / len(v), 4)} for k, v in sorted(groups.items())}


@dataclass
class Summary:
    corpus: Path
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict[str, list[dict[str, Any]]])
    seconds: dict[str, float] = field(default_factory=dict[str, float])

    def add(self, target: str, results: list[dict[str, Any]], seconds: float) -> None:
        self.results[target] = sorted(results, key=lambda r: int(r["index"]))
        self.seconds[target] = seconds

    def counts(self, target: str) -> Counter[str]:
        return Counter(r["outcome"] for r in self.results[target])

    def distinct(self) -> list[dict[str, Any]]:
        groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for rs in self.results.values():
            for r in rs:
                if r["outcome"] in FAILING:
                    groups.setdefault(failure_key(r), []).append(r)
        out: list[dict[str, Any]] = []
        for key, rs in sorted(groups.items()):
            ex = rs[0]
            out.append(
                {
                    "outcome": key[0],
                    "exc_type": ex.get("exc_type", ""),
                    "inner": ex.get("inner", ""),
                    "outer": ex.get("outer", ""),
                    "file": ex.get("file", ""),
                    "where": ex.get("where", ""),
                    "count": len(rs),
                    "targets": sorted({r["target"] for r in rs}),
                    "example": f"{ex['target']}:{ex['seed']}:{ex['index']}",
                    "mode": ex.get("mode", ""),
                    "mutation": ex.get("mutation", ""),
                    "error": ex.get("error", ""),
                    "changed": ex.get("changed", ""),
                    "corpus": str(self.corpus / case_name(ex)),
                }
            )
        return out

    def as_json(self) -> dict[str, Any]:
        targets: dict[str, Any] = {}
        for t, rs in self.results.items():
            secs = self.seconds[t]
            targets[t] = {
                "cases": len(rs),
                "seconds": round(secs, 2),
                "cases_per_s": round(len(rs) / secs, 2) if secs else 0.0,
                "reused": sum(1 for r in rs if int(r.get("reused", -1)) >= 0),
                "outcomes": {o: self.counts(t)[o] for o in OUTCOMES},
                "families": dict(Counter(r.get("family", "") for r in rs)),
                "scheduled": list(FAMILIES[t]),
                "case_seconds_mean": round(sum(float(r.get("seconds", 0)) for r in rs) / max(1, len(rs)), 4),
                "case_seconds_by_outcome": seconds_by(rs, "outcome"),
                "case_seconds_by_family": seconds_by(rs, "family"),
                "failures": [{k: v for k, v in r.items() if k != "traceback"} for r in rs if r["outcome"] in FAILING],
                "results": [{k: r.get(k, "") for k in ("index", "mode", "family", "where", "outcome")} for r in rs],
            }
        return {"corpus": str(self.corpus), "targets": targets, "distinct": self.distinct()}


def print_summary(summary: Summary) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=200)
    table = Table(title="fuzz outcomes per target")
    for col in ["target", "cases", *OUTCOMES, "cases/s", "reused"]:
        table.add_column(col, justify="left" if col == "target" else "right")
    for t, rs in summary.results.items():
        c = summary.counts(t)
        rate = len(rs) / summary.seconds[t] if summary.seconds[t] else 0.0
        reused = sum(1 for r in rs if int(r.get("reused", -1)) >= 0)
        table.add_row(t, str(len(rs)), *[str(c[o]) for o in OUTCOMES], f"{rate:.1f}", str(reused))
    console.print(table)
    distinct = summary.distinct()
    if not distinct:
        console.print("no failing case")
        return
    found = Table(title=f"distinct failures (corpus: {summary.corpus})", show_lines=True)
    for col in ["outcome", "n", "what", "example", "mutation"]:
        found.add_column(col, overflow="fold")
    for d in distinct:
        what = f"{d['exc_type']} at {d['inner']}" if d["outcome"] == "untyped" else f"{d['file']}: {d['where']}"
        if d["outcome"] == "accepted-changed":
            what += f" (view changed: {d['changed']})"
        cells = [d["outcome"], str(d["count"]), what, d["example"], f"[{d['mode']}] {d['mutation']}"]
        found.add_row(*[escape(c) for c in cells])
    console.print(found)
