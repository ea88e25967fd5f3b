"""Pass infrastructure: registry, spec strings, order validation before any pass runs, verification
between passes, IR printing, dumps that re-parse and resume, timing."""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcompiler.errors import PassError, PassNotImplementedError, PipelineError
from qcompiler.examples import tiny_llama
from qcompiler.ir import Module, parse_module, print_module
from qcompiler.ir.core import create_op
from qcompiler.passes import DEFAULT_PIPELINE, PASSES, get_pass_class, pass_names
from qcompiler.passes.base import Pass, PassContext, UnimplementedPass
from qcompiler.passes.manager import Instrumentation, PassManager, remaining_pipeline, validate_pipeline
from qcompiler.passes.spec import format_pipeline, parse_pipeline
from qcompiler.testing import Cli

PIPELINE_PASSES = DEFAULT_PIPELINE.split(",")


def test_all_six_pipeline_passes_are_registered() -> None:
    assert PIPELINE_PASSES == [
        "freeze-semantics",
        "canonicalize-axes",
        "place-shards",
        "pack-layouts",
        "fuse-qdq",
        "emit-container",
    ]
    for name in pass_names():
        cls = get_pass_class(name)
        assert cls is not None
        assert cls.name == name
        # file named after the pass
        assert PASSES[name].split(":")[0].rsplit(".", 1)[-1] == name.replace("-", "_")


@pytest.mark.parametrize(
    "spec",
    [
        DEFAULT_PIPELINE,
        "freeze-semantics,canonicalize-axes,place-shards{tp=2},pack-layouts,fuse-qdq,emit-container{target=gguf}",
        "place-shards{tp=4,max-shard-size=2GB}",
        "pack-layouts{target=onnx,allow-conversion=true}",
        "dce,cse,dce",
        "",
    ],
)
def test_spec_round_trips(spec: str) -> None:
    assert format_pipeline(parse_pipeline(spec)) == spec


@given(st.integers(2, 64), st.sampled_from(["safetensors", "gguf", "onnx", "triton"]))
def test_spec_options_round_trip(tp: int, target: str) -> None:
    spec = f"place-shards{{tp={tp}}},emit-container{{target={target}}}"
    passes = parse_pipeline(spec)
    assert format_pipeline(passes) == spec
    assert vars(passes[0])["tp"] == tp


def test_default_options_are_left_out() -> None:
    assert format_pipeline(parse_pipeline("place-shards{tp=1}")) == "place-shards"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("pack-layout", "unknown pass 'pack-layout' (did you mean 'pack-layouts'?)"),
        ("place-shards{tq=2}", "pass 'place-shards' has no option 'tq' (options: tp, max-shard-size, target)"),
        ("place-shards{tp=two}", "column 1: option 'tp' of 'place-shards' must be an integer, found 'two'"),
        ("dce,place-shards{tp=2", "column 17: '{' is never closed"),
        ("dce,,cse", "column 5: empty pass name"),
        ("place-shards{max-shard-size=[1]", "column 13: '{' is never closed"),
        ("dce{]", "column 5: ']' does not close anything"),
        ("pack-layouts{allow-conversion=yes}", "must be true or false, found 'yes'"),
    ],
)
def test_bad_specs_are_rejected(spec: str, message: str) -> None:
    with pytest.raises(PipelineError, match=None) as info:
        parse_pipeline(spec)
    assert message in str(info.value)


# --------------------------------------------------------------------------- order validation


@pytest.mark.parametrize(
    ("spec", "missing", "hint"),
    [
        ("pack-layouts", "shards-placed", "place-shards"),
        ("canonicalize-axes,freeze-semantics", "semantics-frozen", "freeze-semantics"),
        ("freeze-semantics,place-shards", "axes-canonical", "canonicalize-axes"),
        ("emit-container", "semantics-frozen", "freeze-semantics"),
    ],
)
def test_pass_before_its_prerequisites_is_rejected_before_anything_runs(
    spec: str, missing: str, hint: str, tmp_path: Path
) -> None:
    m = tiny_llama()
    before = print_module(m)
    dump = tmp_path / "dump"
    manager = PassManager(parse_pipeline("dce," + spec), Instrumentation(dump_dir=dump))
    with pytest.raises(PipelineError) as info:
        manager.run(m)
    msg = str(info.value)
    assert "rejected before any pass ran" in msg
    assert f"requires '{missing}'" in msg
    assert f"run '{hint}'" in msg
    assert print_module(m) == before  # dce did not run
    assert not dump.exists()
    assert manager.timings == []


def test_full_default_pipeline_is_ordered_correctly() -> None:
    validate_pipeline(parse_pipeline(DEFAULT_PIPELINE), set())


@dataclass(frozen=True)
class LaterPass(UnimplementedPass):
    """A registered-but-unwritten pass, as a later backend might declare one."""

    name: ClassVar[str] = "test-later"


def test_unimplemented_pass_refuses_to_run() -> None:
    with pytest.raises(PassNotImplementedError):
        LaterPass().run(tiny_llama(), PassContext())
    with pytest.raises(PassNotImplementedError, match="pass 2 of 2 'test-later' is registered but not implemented yet"):
        validate_pipeline([get_dce(), LaterPass()], set())


def get_dce() -> Pass:
    cls = get_pass_class("dce")
    assert cls is not None
    return cls()


def test_claimed_invariants_satisfy_requirements() -> None:
    # a module that already claims axes-canonical may start at place-shards (order check passes)
    validate_pipeline(parse_pipeline("dce"), {"axes-canonical"})
    validate_pipeline(parse_pipeline("place-shards"), {"semantics-frozen", "axes-canonical"})


# --------------------------------------------------------------------------- running


@dataclass(frozen=True)
class BreakReturnPass(Pass):
    """A deliberately wrong pass (drops the graph's return) to prove the verifier runs after passes."""

    name: ClassVar[str] = "test-break-return"

    def run(self, module: Module, ctx: PassContext) -> Module:
        module.graphs[0].ops.pop()
        return module


@dataclass(frozen=True)
class EstablishPass(Pass):
    """Claims an invariant it does not make true; the verifier must catch the false claim."""

    name: ClassVar[str] = "test-claim-packed"
    establishes: ClassVar[frozenset[str]] = frozenset({"layouts-packed"})

    def run(self, module: Module, ctx: PassContext) -> Module:
        return module


def test_verifier_runs_after_each_pass() -> None:
    with pytest.raises(PassError, match=r"IR after pass 'test-break-return' does not verify: .*must end with return"):
        PassManager([BreakReturnPass()]).run(tiny_llama())


def test_verifier_can_be_switched_off() -> None:
    m = PassManager([BreakReturnPass()], Instrumentation(verify_each=False)).run(tiny_llama())
    assert m.graphs[0].ops[-1].name != "return"


def test_false_invariant_claims_are_caught() -> None:
    with pytest.raises(PassError, match="invariant layouts-packed: weight is still in the logical layout"):
        PassManager([EstablishPass()]).run(tiny_llama())


def test_established_invariants_are_recorded() -> None:
    m = tiny_llama()
    m = PassManager([EstablishPass()], Instrumentation(verify_each=False)).run(m)
    assert m.invariants == ["layouts-packed"]


def with_dead_code() -> Module:
    m = tiny_llama()
    g = m.graphs[0]
    dead = create_op("exp", [g.args[1]], [g.args[1].type], result_names=["dead"])
    g.ops.insert(0, dead)
    return m


def test_print_ir_after_change_only_prints_changed_passes() -> None:
    stream = io.StringIO()
    ins = Instrumentation(print_after_change=True, stream=stream)
    PassManager(parse_pipeline("dce,cse,dce"), ins).run(with_dead_code())
    out = stream.getvalue()
    assert out.count("IR Dump After") == 1
    assert "IR Dump After dce (pass 1 of 3)" in out


def test_print_ir_after_all_and_named() -> None:
    stream = io.StringIO()
    PassManager(parse_pipeline("dce,cse"), Instrumentation(print_after_all=True, stream=stream)).run(tiny_llama())
    assert stream.getvalue().count("IR Dump After") == 2
    stream = io.StringIO()
    ins = Instrumentation(print_after=frozenset({"cse"}), stream=stream)
    PassManager(parse_pipeline("dce,cse"), ins).run(tiny_llama())
    assert stream.getvalue().count("IR Dump After cse") == 1
    assert "IR Dump After dce" not in stream.getvalue()


def test_dump_files_reparse_and_resume(tmp_path: Path, cli: Cli) -> None:
    src = tmp_path / "in.qir"
    src.write_text(print_module(with_dead_code()))
    dump = tmp_path / "dump"
    full = cli("opt", str(src), "--pipeline", "dce,cse,dce", "--dump-ir", str(dump))
    assert full.code == 0, full.err
    files = sorted(p.name for p in dump.iterdir())
    assert files == ["00_dce.qir", "01_cse.qir", "02_dce.qir", "blobs"]
    # in-memory weights are written once, content-addressed, so each dump re-reads with its bytes
    assert len(list((dump / "blobs").iterdir())) == len(
        {d.blob.sha256 for d in parse_module(full.out).tensors.values()}
    )
    first = parse_module((dump / "00_dce.qir").read_text())
    assert remaining_pipeline(first) == "cse,dce"
    assert remaining_pipeline(parse_module((dump / "02_dce.qir").read_text())) == ""
    resumed = cli("opt", str(dump / "00_dce.qir"), "--verify-data")
    assert resumed.code == 0, resumed.err
    assert same_but_locations(resumed.out, full.out)
    # the last dump has nothing left to run: it prints its canonical form
    last = cli("opt", str(dump / "02_dce.qir"))
    assert same_but_locations(last.out, full.out)


def same_but_locations(a: str, b: str) -> bool:
    """Equal IR text once blob locations (``mem`` / ``file:blobs/<sha>.bin``) are ignored."""
    pattern = r'"(mem|file:blobs/[0-9a-f]{64}\.bin)">'
    return re.sub(pattern, '"LOC">', a) == re.sub(pattern, '"LOC">', b)


def test_time_passes_prints_a_table(tmp_path: Path, cli: Cli) -> None:
    src = tmp_path / "in.qir"
    src.write_text(print_module(tiny_llama()))
    r = cli("opt", str(src), "-p", "dce,cse", "--time-passes")
    assert r.code == 0
    assert "pass timing" in r.err
    assert "cse" in r.err


def test_pass_failures_name_the_pass_and_history() -> None:
    @dataclass(frozen=True)
    class Boom(Pass):
        name: ClassVar[str] = "test-boom"

        def run(self, module: Module, ctx: PassContext) -> Module:
            raise ValueError("kaput")

    with pytest.raises(PassError, match=r"internal error in pass 'test-boom' \(after: dce\): ValueError: kaput"):
        PassManager([*parse_pipeline("dce"), Boom()]).run(tiny_llama())


def test_dce_and_cse_do_their_work() -> None:
    m = with_dead_code()
    n_tensors = len(m.tensors)
    ctx = PassContext()
    m = PassManager(parse_pipeline("dce,cse"), Instrumentation()).run(m, ctx)
    assert ctx.stats["dce.ops-removed"] == 1
    assert len(m.tensors) == n_tensors
    # the three RMS-norm weights are identical ones-vectors, but distinct tensors: cse keeps them
    assert ctx.stats["cse.ops-merged"] == 0


def test_target_options_are_typed_options_of_emit_container() -> None:
    from qcompiler.backends import get_backend
    from qcompiler.passes.emit_container import EmitContainerPass

    spec = "emit-container{target=onnx-nbits,accuracy-level=4}"
    (p,) = parse_pipeline(spec)
    assert isinstance(p, EmitContainerPass)
    assert p.accuracy_level == 4
    assert format_pipeline([p]) == spec
    assert p.target_options("onnx-nbits", get_backend("onnx-nbits").options) == {"accuracy_level": "4"}
    with pytest.raises(PipelineError, match="accuracy-level' of 'emit-container' must be an integer"):
        parse_pipeline("emit-container{accuracy-level=fast}")
    with pytest.raises(PassError, match=r"target gguf takes no option accuracy-level \(it takes: \[\]\)"):
        EmitContainerPass("gguf", 4).target_options("gguf", get_backend("gguf").options)
    with pytest.raises(PassError, match="accuracy-level must be 0-4"):
        EmitContainerPass("onnx-nbits", 9).target_options("onnx-nbits", get_backend("onnx-nbits").options)
    assert EmitContainerPass("gguf").target_options("gguf", frozenset()) == {}
