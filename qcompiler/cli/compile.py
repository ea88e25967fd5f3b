"""qcompiler compile SOURCE -o OUT --target T [--scheme S] [--pipeline SPEC] [--allow-conversion]
[--max-shard-size SIZE] [--force] [--print-ir-after-all] [--dump-ir DIR]: load a model (an HF-style directory, a
.gguf file or pkg.module:factory), quantize it with the built-in quantizer when --scheme is given (codes are frozen
from then on), capture it with torch.export, run the pass pipeline, and write the artifact OUT.

With --target the full pipeline runs (freeze-semantics, canonicalize-axes, place-shards,
pack-layouts, fuse-qdq, emit-container) and OUT is the artifact directory, published
transactionally and reopened through the production reader. OUT may be absent, an empty directory
or an artifact; anything else (a file, a symlink, another directory) is refused before the slow
capture unless --force. While it runs the compile holds OUT's lock: a second compile of OUT fails
at once. Without --target the front half runs
(freeze-semantics, canonicalize-axes, fuse-qdq) and the final IR goes to -o (or standard output).
A summary with the parity rungs goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from qcompiler import plugins
from qcompiler.artifact.output import LIVE, claim_output, leftover_path
from qcompiler.artifact.reader import read_manifest
from qcompiler.artifact.request import ArtifactRequest
from qcompiler.backends import get_backend, targets
from qcompiler.errors import UsageError
from qcompiler.interrupt import deferred
from qcompiler.ir.blobs import spilled
from qcompiler.ir.printer import print_module
from qcompiler.ir.relocate import relocate_to_files
from qcompiler.parallel import kernel_threads
from qcompiler.passes import DEFAULT_PIPELINE, Pass
from qcompiler.passes.ahead import Ahead
from qcompiler.passes.base import PassContext
from qcompiler.passes.manager import Instrumentation, PassManager
from qcompiler.passes.spec import format_pipeline, parse_pipeline
from qcompiler.proofs import Proofs
from qcompiler.quant.registry import whole_model

if TYPE_CHECKING:
    from qcompiler.api import AheadFactory, Captured
    from qcompiler.ir.core import Module


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        help="HF-style model directory (config.json + safetensors), a .gguf file (codes kept as they are), "
        "or pkg.module:factory",
    )
    p.add_argument(
        "-o",
        "--output",
        help="with --target: the artifact directory; without: write the final IR here, tensors in blobs/ beside it",
    )
    p.add_argument("--target", help=f"backend to emit: {', '.join(targets())} (needs -o)")
    p.add_argument(
        "--allow-conversion",
        action="store_true",
        help="let pack-layouts convert weights the target cannot hold exactly (error measured, recorded)",
    )
    p.add_argument(
        "--accuracy-level",
        type=int,
        choices=range(5),
        help="onnx targets: MatMulNBits accuracy_level (1: fp32 compute, the default; 4: int8 activations, faster)",
    )
    p.add_argument(
        "--onnx-no-cache-graph",
        action="store_true",
        help="onnx targets, causal LMs: also write model_no_cache.onnx, the graph without the KV cache "
        "(input_ids in, logits out); model.onnx is the KV-cache decoder graph",
    )
    p.add_argument(
        "--onnx-attention",
        metavar="FORM",
        help="onnx targets, causal LMs: the decoder graph's attention, 'decomposed' (plain ops, the default) or "
        "'gqa' (onnxruntime's GroupQueryAttention; onnxruntime-genai shares the past and present buffers)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --target: replace OUT even if it is a file, a symlink or a directory that is not an artifact",
    )
    p.add_argument("--max-shard-size", help="largest checkpoint file, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    p.add_argument(
        "--scheme",
        help="quantize a float model first: w8-channel, w8-g32, w4-g32, w4-g128-asym, w2-g16-asym; "
        "mixed-2416[-g<G>][-s<G2>][-r<bits>][-o<fraction>][-layers] (2/4-bit groups, 16-bit outliers); or a scheme "
        f"a backend declares: {', '.join(plugins.declared('SCHEMES'))}",
    )
    p.add_argument("--embeddings", action="store_true", help="with --scheme: quantize embedding tables too")
    p.add_argument(
        "--calibration",
        metavar="FILE",
        help="with --scheme mixed-2416[...]: calibration text, one per line (sensitivity from activations)",
    )
    p.add_argument(
        "--pipeline", "-p", help="pass pipeline (default: the full pipeline with --target, else the front half)"
    )
    p.add_argument("--stop-after", metavar="PASS", help="run the pipeline up to and including PASS")
    p.add_argument("--dump-ir", metavar="DIR", help="write input.qir, then NN_<pass>.qir after every pass")
    p.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass (to stderr)")
    p.add_argument("--no-verify", action="store_true", help="do not verify between passes")
    p.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=0,
        help="workers quantizing tensors in parallel (default: all cores); the output is the same for any N",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars and no summary table")


FRONT_PIPELINE = "freeze-semantics,canonicalize-axes,fuse-qdq"


def with_target(spec: str, args: argparse.Namespace) -> str:
    """Fill the target-dependent options the command line gives into the passes that take them."""
    passes: list[Pass] = []
    for p in parse_pipeline(spec):
        fields = {f.name for f in dataclasses.fields(p)}
        changes: dict[str, object] = {}
        if args.target and "target" in fields and not getattr(p, "target"):  # noqa: B009
            changes["target"] = args.target
        if args.allow_conversion and "allow_conversion" in fields:
            changes["allow_conversion"] = True
        if args.max_shard_size and "max_shard_size" in fields:
            changes["max_shard_size"] = args.max_shard_size
        if args.accuracy_level is not None and "accuracy_level" in fields:
            changes["accuracy_level"] = args.accuracy_level
        if args.onnx_no_cache_graph and "no_cache_graph" in fields:
            changes["no_cache_graph"] = True
        if args.onnx_attention is not None and "attention" in fields:
            changes["attention"] = args.onnx_attention
        passes.append(dataclasses.replace(p, **changes) if changes else p)
    return format_pipeline(passes)


def truncate(spec: str, stop_after: str | None) -> str:
    passes = parse_pipeline(spec)
    if stop_after is None:
        return spec
    names = [p.name for p in passes]
    if stop_after not in names:
        raise UsageError(f"--stop-after {stop_after}: not in the pipeline ({', '.join(names)})")
    return format_pipeline(passes[: names.index(stop_after) + 1])


def run(args: argparse.Namespace) -> int:
    if args.target and not args.output:
        raise UsageError("--target needs -o OUT, the artifact directory to publish")
    if args.target:
        backend = get_backend(args.target)  # an unknown target fails before the slow capture
        if (Path(args.source) / "config.json").is_file():  # and a model it cannot write
            from qcompiler.frontend.hf_dir import read_config

            backend.check_source_config(read_config(Path(args.source), quantized=True), args.scheme)
    default = DEFAULT_PIPELINE if args.target else FRONT_PIPELINE
    spec = with_target(truncate(args.pipeline or default, args.stop_after), args)
    PassManager(parse_pipeline(spec))  # reject a malformed spec before the slow capture
    if args.force and not args.target:
        raise UsageError("--force needs --target: it lets the artifact replace what is at -o OUT")
    if args.jobs < 0:
        raise UsageError(f"--jobs must be 0 (all cores) or a positive count, found {args.jobs}")
    if args.calibration and not whole_model(args.scheme):
        raise UsageError(
            f"--calibration weighs a scheme's errors by activations: it needs --scheme mixed-2416[...], "
            f"found --scheme {args.scheme}"
        )
    with ExitStack() as stack:
        if args.target and "emit-container" in [p.name for p in parse_pipeline(spec)]:
            # refuse OUT, or find it busy, before the slow capture; the lock is held until the reopen
            stack.enter_context(claim_output(args.output, force=args.force))
        stack.enter_context(spilled(spill_dir(stack, args.output)))
        return build(args, spec)


def spill_dir(stack: ExitStack, output: str | None) -> Path:
    """A temp directory for the blob store, removed on any exit: beside OUT (same file system) as
    ``.OUT.spill-<pid>-<id>``, which the next compile of OUT removes if this one is SIGKILLed."""
    with deferred():  # a signal between the mkdir and the callback would leave the directory behind
        if not output or not Path(output).absolute().parent.is_dir():
            path = Path(tempfile.mkdtemp(prefix=".qc-spill-"))
        else:
            path = leftover_path(Path(output).absolute(), "spill")
            path.mkdir()
            stack.callback(LIVE.discard, str(path.absolute()))
        stack.callback(shutil.rmtree, path, True)
    return path


def build(args: argparse.Namespace, spec: str) -> int:
    """Capture, run ``spec``, publish (with --target) and report; ``run`` checked the arguments."""
    from qcompiler.api import capture_source
    from qcompiler.quant.calibration import calibrating, read_calibration

    console = Console(stderr=True, width=max(Console(stderr=True).width, 150), quiet=args.quiet)
    jobs = args.jobs or os.cpu_count() or 1
    with Progress(*progress_columns(), console=console, transient=True, disable=args.quiet) as bars:

        def reading(total: int) -> Callable[[int], None]:
            task = bars.add_task(f"reading and quantizing {args.source} ({jobs} jobs)", total=total)
            return lambda n: bars.advance(task, n)

        bars.add_task(f"loading {args.source}, then capturing it with torch.export", total=None)
        scales = get_backend(args.target).scales if args.target else "f32"
        proofs = Proofs()
        texts = read_calibration(args.calibration) if args.calibration else None
        with calibrating(texts):
            captured = capture_source(
                args.source,
                scheme=args.scheme,
                embeddings=args.embeddings,
                jobs=jobs,
                progress=reading,
                scales=scales,
                ahead=ahead_for(spec, args.target, proofs),
            )
    m = captured.module
    dump = Path(args.dump_ir) if args.dump_ir else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "input.qir").write_text(f"// remaining-pipeline: {spec}\n" + print_module(relocate_to_files(m, dump)))
    instrument = Instrumentation(verify_each=not args.no_verify, print_after_all=args.print_ir_after_all, dump_dir=dump)
    request = None
    if args.target:
        request = ArtifactRequest(
            Path(args.output),
            captured.source,
            captured.effective,
            captured.float_weights,
            pipeline=spec,
            force=args.force,
            jobs=jobs,
            proofs=proofs,
        )
    ctx = PassContext(base_dir=m.base_dir, artifact=request, jobs=jobs)
    # the passes' workers are the parallelism: the graph probe beside writing the files is one of them
    # (with torch's second intra-op thread, the 1.1B probe took 3.7 CPU-s for 2.0 s; alone, 1.9)
    with console.status(f"running {spec}"), kernel_threads(jobs):
        m = PassManager(parse_pipeline(spec), instrument).run(m, ctx)
    if request is not None and "artifact" in m.attrs:
        # the artifact was reopened once through the production reader before it was published; the
        # parity it proved there is in its manifest
        manifest = read_manifest(Path(args.output))
        console.print(manifest_summary(manifest, args.output))
        console.print(f"published {args.output} ({args.target}); reopened through every reader gate")
        return 0
    if request is not None:
        console.print(f"[yellow]the pipeline has no emit-container, so nothing was written to {args.output}[/yellow]")
        return 0
    if args.output:
        out = Path(args.output)
        out.write_text(print_module(relocate_to_files(m, out.parent)))
    else:
        sys.stdout.write(print_module(m))
    console.print(summary(captured, m))
    return 0


def ahead_for(spec: str, target: str | None, proofs: Proofs) -> AheadFactory | None:
    """The stream's per-weight hook (``passes/ahead.py``) when ``spec`` freezes and emits an artifact:
    each weight is frozen, and packed for ``target`` when ``spec`` packs, where the stream holds it."""
    names = [p.name for p in parse_pipeline(spec)]
    if not target or "freeze-semantics" not in names or "emit-container" not in names:
        return None
    pack = target if "pack-layouts" in names else None
    return lambda prov: Ahead(proofs, pack, str(prov.get("model_dtype", "")))


SUMMARY_ROWS = 12
"""Weights listed one per row by the published summary; a larger model gets the worst ones and a total."""


def manifest_summary(manifest: dict[str, Any], out: str) -> Table:
    """The parity the published artifact's manifest records (rungs 1-3), worst operator errors first."""
    parity = manifest.get("parity", {})
    r3: dict[str, dict[str, float]] = parity.get("rung3_operators", {})
    from qcompiler.report import origin

    converted: dict[str, list[dict[str, Any]]] = {}
    for c in manifest.get("conversions", []):
        if isinstance(c, dict):
            converted.setdefault(str(c.get("tensor")), []).append(c)
    r1, r2 = parity.get("rung1_pack_unpack", {}), parity.get("rung2_reconstruction", {})
    table = Table(
        title=f"{out}: {r2.get('weights', 0)} quantized weights; pack/unpack {r1.get('passed')}/{r1.get('weights')}, "
        f"decode == source {r2.get('bit_exact')}/{r2.get('weights')} bit-exact ({r2.get('reference')})"
    )
    for col in ("weight", "decode == source", "rel E_kernel", "rel E_quant"):
        table.add_column(col, no_wrap=True)
    names = sorted(r3, key=lambda n: -float(r3[n].get("rel_quant", 0.0)))
    for name in names[:SUMMARY_ROWS]:
        records = converted.get(name, [])
        exact = origin(records, {}) if records else "exact"  # converted, or preserved through a lossless rewrite
        quant = f"{r3[name]['rel_quant']:.2e}" if "rel_quant" in r3[name] else "-"
        table.add_row(name, exact, f"{r3[name]['rel_kernel']:.2e}", quant)
    if len(names) > SUMMARY_ROWS:
        worst = max((float(v.get("rel_kernel", 0.0)) for v in r3.values()), default=0.0)
        table.add_row(f"... {len(names) - SUMMARY_ROWS} more", "", f"max {worst:.2e}", "")
    for name, records in converted.items():
        for c in records:
            if c.get("kind") == "dense":
                table.add_row(name, f"converted to dense (rel L2 {float(c['rel_l2']):.1e})", "-", "-")
    return table


def progress_columns() -> list[ProgressColumn]:
    return [
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    ]


def summary(captured: Captured, m: Module) -> Table:
    """Rungs 1-3 per weight: on the in-memory module, or (after emit-container) as recorded in the
    manifest from the reopened artifact; a converted weight shows its conversion and error."""
    from qcompiler.ir.module_attrs import conversions
    from qcompiler.parity import RungResult, rung1_pack_unpack, rung2_reconstruction, rung3_operators

    converted = {str(c["tensor"]): c for c in conversions(m) if isinstance(c, dict)}
    rows1 = rung1_pack_unpack(m)
    if captured.effective:
        rows2 = rung2_reconstruction(m, captured.effective)
    else:  # a streamed source: freeze-semantics proved each decode equal to the source's, weight by weight
        rows2 = [RungResult(2, r.tensor, True, "proven by freeze-semantics") for r in rows1]
    rows3 = {r.tensor: r for r in rung3_operators(m, captured.float_weights)}
    where = f", artifact {m.attrs['artifact']}" if "artifact" in m.attrs else ""
    table = Table(title=f"module @{m.name}: {len(rows2)} quantized weights{where}")
    table.add_column("weight", no_wrap=True)
    for col in ("pack/unpack", "decode == source", "rel E_kernel", "rel E_quant"):
        table.add_column(col, no_wrap=True)
    for r1, r2 in zip(rows1, rows2, strict=True):
        r3 = rows3.get(r2.tensor)
        kern = f"{r3.metrics['rel_kernel']:.2e}" if r3 else "-"
        quant = f"{r3.metrics['rel_quant']:.2e}" if r3 and "rel_quant" in r3.metrics else "-"
        c = converted.get(r2.tensor)
        exact = "exact" if r2.ok else f"FAIL {r2.detail}"
        if c is not None:
            exact = f"converted ({c['kind']}, rel L2 {float(c['rel_l2']):.1e})"  # type: ignore[arg-type]
        table.add_row(r2.tensor, "ok" if r1.ok else "FAIL", exact, kern, quant)
    for name, c in converted.items():
        if c.get("kind") == "dense":
            table.add_row(name, "-", f"converted to dense (rel L2 {float(c['rel_l2']):.1e})", "-", "-")  # type: ignore[arg-type]
    return table
