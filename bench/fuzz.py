"""Structure-aware fuzzer of the artifact readers: ``verify_artifact(level=3)`` then ``load`` on
mutated copies of four small artifacts (the tiny Llama compiled to each target).

Each case applies one mutation chosen by an RNG seeded with ``target:seed:index`` (so any case can be
rebuilt alone): a JSON field of the manifest, config.json or kernels/index.json; a GGUF key-value or
tensor-info record; an ONNX protobuf field; a safetensors header entry; a graph.qir token or line;
raw bytes of any file; or a file-level change (delete, add, links, FIFO). 85% of cases then rehash
the manifest (``files`` and ``self_sha256`` recomputed, as a careless tool or an attacker would), so
the deep gates are reached; the rest leave it as it is, so the hash gate must reject.

Outcomes (``fuzz_classify.py``): ``typed``, ``accepted-unchanged``, ``accepted-changed`` (accepted
corruption), ``untyped``, ``hang``, ``memory``, ``crash``, ``fuzzer-error``. Failing cases go to the
corpus as the mutated directory plus ``case.json``.

    python bench/fuzz.py --target all --cases 1000 --seed 0 --workers 2 --json out.json
    python bench/fuzz.py --replay gguf:0:17          # one case, in process, full traceback
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

_here = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == _here.parent:
    sys.path.pop(0)  # the checkout's qcompiler/ folder would shadow the installed package
sys.path.insert(0, str(_here))
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before torch is imported: workers are forked, one thread each
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TQDM_DISABLE", "1")

from fuzz_classify import Result, build_case, evaluate, run_case, view  # noqa: E402
from fuzz_report import FAILING, Summary, copy_case, print_summary, write_case  # noqa: E402

TARGETS = {"safetensors": ("w4-g32", "safetensors"), "gguf": ("q4_0", "gguf"), "onnx": ("w4-g32", "onnx-nbits")}
TARGETS["triton"] = ("w4-g32", "triton")
EXTRA = {"onnx": ("--onnx-no-cache-graph",)}
"""Flags of a base compile: the onnx base holds both graphs, so edits reach the no-cache graph too."""
MODEL = "qcompiler.examples:tiny_llama_hf"
SMALL = "fuzz_model:llama_1layer"


def quiet() -> None:
    """Silence third-party warnings, log lines and progress bars (the fuzzer prints its own)."""
    import logging

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def silent_stderr() -> tuple[int, int]:
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    return saved, devnull


def restore_stderr(fds: tuple[int, int]) -> None:
    os.dup2(fds[0], 2)
    os.close(fds[0])
    os.close(fds[1])


def base_artifact(target: str, bases: Path, model: str = MODEL) -> tuple[Path, dict[str, str]]:
    """The tiny Llama compiled for ``target`` under ``bases`` (reused if present and it still
    verifies with this checkout, else compiled again), after every reader ran on it once (so forked
    workers start warm); with its consumer view."""
    from qcompiler.testing import run_cli

    out = bases / model.replace(":", "-") / f"base-{target}"
    if (out / "manifest.json").is_file():
        try:
            return out, warm(out)
        except SystemExit:
            shutil.rmtree(out)
    scheme, compile_target = TARGETS[target]
    r = run_cli(
        "compile", model, "--scheme", scheme, "--target", compile_target, "-o", str(out), *EXTRA.get(target, ())
    )
    if r.code != 0:
        raise SystemExit(f"compiling the {target} base artifact failed:\n{r.err[-3000:]}")
    return out, warm(out)


def warm(base: Path) -> dict[str, str]:
    """Run verify and load on the base artifact; its consumer view."""
    from qcompiler.report import verify_artifact
    from qcompiler.runtime import load

    report = verify_artifact(base, level=3)
    if not report["ok"]:
        raise SystemExit(f"the base artifact {base} does not verify: {report.get('error')}")
    load(base)
    return view(base, remember=True)


def runner_for(bases: dict[str, Path], views: dict[str, dict[str, str]], corpus: Path) -> Any:
    def run(job: tuple[str, int, int], scratch: Path, built: Any) -> dict[str, Any]:
        target, seed, index = job
        result = run_case(target, seed, index, bases[target], scratch, views[target], built)
        if result.outcome in FAILING:
            write_case(corpus, scratch, result.as_dict())
        return result.as_dict()

    return run


def collector(results: list[dict[str, Any]], progress: Any, task: Any, corpus: Path) -> Any:
    """The pool's callback: keep the result, write killed cases to the corpus, advance the bar."""

    def done(result: dict[str, Any], folder: Path) -> None:
        if result["outcome"] in ("hang", "memory", "crash"):
            copy_case(corpus, folder, result)
        results.append(result)
        progress.advance(task)
        progress.refresh()

    return done


def fuzz(
    args: argparse.Namespace, bases: dict[str, Path], views: dict[str, dict[str, str]], corpus: Path, scratch: Path
) -> Summary:
    from fuzz_pool import Pool
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    summary = Summary(corpus)
    pool = Pool(args.workers, runner_for(bases, views, corpus), scratch, args.timeout, args.rss_mb)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, auto_refresh=False, transient=True) as progress:
            for target in bases:
                task = progress.add_task(f"fuzz {target}", total=args.cases)
                t0 = time.perf_counter()
                results: list[dict[str, Any]] = []

                pool.run(
                    [(target, args.seed, i) for i in range(args.cases)], collector(results, progress, task, corpus)
                )
                summary.add(target, results, time.perf_counter() - t0)
    finally:
        pool.close()
    return summary


def replay(spec: str, bases_dir: Path, scratch: Path, corpus: Path, model: str) -> int:
    """Re-run one case in this process; print its outcome and full traceback, keep it in ``corpus``."""
    target, seed, index = spec.split(":")
    base, base_view = base_artifact(target, bases_dir, model)
    result = Result(target, int(seed), int(index))
    work = scratch / "replay"
    root, result.mode, m = build_case(target, int(seed), int(index), base, work)
    result.family, result.file, result.where, result.mutation = m.family, m.file, m.where, m.detail
    evaluate(root, result, base_view, base)
    for key in ("target", "seed", "index", "mode", "family", "file", "where", "mutation", "outcome", "stage", "error"):
        print(f"{key}: {getattr(result, key)}")
    if result.changed:
        print(f"changed in the consumer view: {result.changed}")
    if result.traceback:
        print(result.traceback)
    print(f"case written to {write_case(corpus, work, result.as_dict())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="all", choices=[*TARGETS, "all"])
    p.add_argument("--cases", type=int, default=200, help="cases per target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per case before it is a hang")
    p.add_argument("--rss-mb", type=float, default=4096.0, help="resident memory per worker before a case is memory")
    p.add_argument("--corpus", type=Path, help="where failing cases go (default: a folder under the temp dir)")
    p.add_argument("--bases", type=Path, help="keep the compiled base artifacts here and reuse them")
    p.add_argument("--json", type=Path, help="write the summary as JSON")
    p.add_argument("--replay", metavar="TARGET:SEED:INDEX", help="re-run one case in process")
    p.add_argument("--model", default=MODEL, help=f"source of the base artifacts (default {MODEL}; smaller: {SMALL})")
    args = p.parse_args(argv)
    quiet()
    fds = silent_stderr()
    try:
        importlib.import_module("qcompiler.runtime")  # the heavy imports, their load-time chatter silenced
        importlib.import_module("torch").set_num_threads(1)  # before any op: no thread pool in a forked worker
    finally:
        restore_stderr(fds)
    with tempfile.TemporaryDirectory(prefix="qcompiler-fuzz-") as tmp:
        bases_dir = args.bases or Path(tmp) / "bases"
        scratch = Path(tmp) / "work"
        corpus = args.corpus or Path(tempfile.gettempdir()) / f"qcompiler-fuzz-corpus-{args.seed}"
        if args.replay:
            return replay(args.replay, bases_dir, scratch, corpus, args.model)
        targets = list(TARGETS) if args.target == "all" else [args.target]
        fds = silent_stderr()
        try:
            built = {t: base_artifact(t, bases_dir, args.model) for t in targets}
        finally:
            restore_stderr(fds)
        bases, views = {t: b for t, (b, _) in built.items()}, {t: v for t, (_, v) in built.items()}
        summary = fuzz(args, bases, views, corpus, scratch)
    print_summary(summary)
    if args.json:
        args.json.write_text(json.dumps(summary.as_json(), indent=2) + "\n")
    counts = Counter(r["outcome"] for rs in summary.results.values() for r in rs)
    return 1 if any(counts[o] for o in FAILING) else 0


if __name__ == "__main__":
    sys.exit(main())
