"""The worker pool of ``bench/fuzz.py``: long-lived processes forked from the warm parent (qcompiler,
torch and onnx already imported, every reader already run once), one case at a time each.

A case whose mutated tree is byte for byte one an earlier case left (same ``digest``) takes over
that case's outcome instead of running the readers again. The parent watches every busy worker:
past ``timeout`` seconds on one case it is killed and the case is a ``hang``; above ``rss_mb`` of
resident memory (read from ``/proc/<pid>/statm``, since ``RLIMIT_AS`` breaks torch's address-space
reservations) it is killed and the case is ``memory``; a worker that dies on its own (a native
crash) makes the case a ``crash``. A killed worker is replaced by a fresh fork. Each worker owns a
scratch folder, where a killed case's files stay for the corpus.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

Job = tuple[str, int, int]
"""(target, seed, index)."""
Runner = Callable[[Job, Path, Callable[[dict[str, Any]], dict[str, Any] | None]], dict[str, Any]]
"""Runs one job in a worker's scratch folder; calls its third argument with the case's description
as soon as the mutation is applied (so a killed case still has one), which answers with the result
of an earlier case that left the same tree (``digest``), if any."""
PAGE = os.sysconf("SC_PAGE_SIZE")
POLL_S = 0.05
CACHED = ("typed", "accepted-unchanged", "accepted-changed", "untyped")
"""Outcomes a later case with the same tree takes over (hang, memory and crash are run again)."""


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def _serve(conn: Connection, runner: Runner, scratch: Path) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (the worker's whole life)
    while True:
        job = conn.recv()
        if job is None:
            return
        result = runner(job, scratch, lambda partial: ask(conn, partial))
        conn.send(("done", result))


def ask(conn: Connection, partial: dict[str, Any]) -> dict[str, Any] | None:
    """Tell the parent what the case is; it answers with an earlier identical case's result or None."""
    conn.send(("built", partial))
    return conn.recv()


@dataclass
class _Worker:
    slot: int
    proc: Any
    conn: Connection
    job: Job | None = None
    started: float = 0.0
    partial: dict[str, Any] | None = None


class Pool:
    """``Pool(n, runner, scratch, timeout, rss_mb).run(jobs, done)`` calls ``done(result, scratch)``
    for every job, in completion order."""

    def __init__(self, n: int, runner: Runner, scratch: Path, timeout: float, rss_cap_mb: float) -> None:
        self.ctx = mp.get_context("fork")
        self.runner, self.scratch, self.timeout, self.rss_cap = runner, scratch, timeout, rss_cap_mb
        self.workers = [self._spawn(i) for i in range(n)]
        self.seen: dict[tuple[str, str], dict[str, Any]] = {}
        """(target, tree digest) -> the first result of a case that left that tree."""

    def _spawn(self, slot: int) -> _Worker:
        parent, child = self.ctx.Pipe()
        folder = self.scratch / f"w{slot}"
        proc = self.ctx.Process(target=_serve, args=(child, self.runner, folder), daemon=True)
        proc.start()
        child.close()
        return _Worker(slot, proc, parent)

    def _replace(self, w: _Worker) -> None:
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join()
        w.conn.close()
        self.workers[w.slot] = self._spawn(w.slot)

    def run(self, jobs: Iterable[Job], done: Callable[[dict[str, Any], Path], None]) -> None:
        pending = deque(jobs)
        while pending or any(w.job is not None for w in self.workers):
            for w in self.workers:
                if w.job is None and pending:
                    w.job, w.started, w.partial = pending.popleft(), time.monotonic(), None
                    w.conn.send(w.job)
            busy = [w for w in self.workers if w.job is not None]
            ready = wait([w.conn for w in busy], timeout=POLL_S)
            for w in busy:
                if w.conn in ready:
                    self._receive(w, done)
                elif time.monotonic() - w.started > self.timeout:
                    self._kill(w, "hang", f"no result after {self.timeout:g} s", done)
                elif (mb := rss_mb(w.proc.pid)) > self.rss_cap:
                    self._kill(w, "memory", f"resident memory {mb:.0f} MB > {self.rss_cap:g} MB", done)

    def _receive(self, w: _Worker, done: Callable[[dict[str, Any], Path], None]) -> None:
        try:
            kind, payload = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join(timeout=5)
            code = w.proc.exitcode
            self._kill(w, "crash", f"worker died (exit code {code})", done)
            return
        if kind == "built":
            w.partial = payload
            w.conn.send(self.seen.get((payload["target"], payload["digest"])))
            return
        if payload.get("outcome") in CACHED and payload.get("reused", -1) < 0 and payload.get("digest"):
            self.seen.setdefault((payload["target"], payload["digest"]), payload)
        job = w.job
        w.job = None
        assert job is not None
        done(payload, self.scratch / f"w{w.slot}")

    def _kill(self, w: _Worker, outcome: str, why: str, done: Callable[[dict[str, Any], Path], None]) -> None:
        assert w.job is not None
        target, seed, index = w.job
        result: dict[str, Any] = dict(w.partial or {"target": target, "seed": seed, "index": index})
        result.update(outcome=outcome, error=why, seconds=time.monotonic() - w.started)
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join()
        w.job = None
        done(result, self.scratch / f"w{w.slot}")
        self._replace(w)

    def close(self) -> None:
        for w in self.workers:
            with contextlib.suppress(OSError):
                w.conn.send(None)
        for w in self.workers:
            w.proc.join(timeout=5)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
