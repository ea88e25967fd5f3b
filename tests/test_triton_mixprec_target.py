"""``--scheme mixed-2416 --target triton`` end to end: every quantized linear of the tiny Llama is stored
exactly in ``mixprec`` v1 ``planes-a16``, the artifact brings the generated mixed 2/4-bit kernel (kind
``mixprec`` in the index, AOT evidence for sm_80 and sm_90), the reader regenerates its source from the
key and refuses any other text, ``run --device interpret`` dispatches every linear to it and decodes the
same greedy tokens as the CPU kernel (``cpu.mixprec``) on the same artifact, ``verify`` reports its
interpreter parity, and admission refuses by name on a device with too little shared memory."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from qcompiler.artifact.reader import ArtifactError
from qcompiler.backends import get_backend
from qcompiler.backends.triton.mixprec_plan import plan
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.types import DenseType, QuantType
from qcompiler.runtime.kernels import DeviceLimits, quantized_ops
from qcompiler.runtime.load import decide, resolve_place
from qcompiler.testing import run_cli

FACTORY = "qcompiler.examples:tiny_llama_wide_hf"
KERNEL = "qlinear_mix24_g64_s2g64_af32_of32_outl"
PROMPT = "1,2,3"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mixtri") / "mix"
    r = run_cli("compile", FACTORY, "--scheme", "mixed-2416", "--target", "triton", "-o", str(out), "-q")
    assert r.code == 0, r.err
    return out


def test_the_artifact_stores_planes_and_the_mixprec_kernel(artifact: Path) -> None:
    files = sorted(p.relative_to(artifact).as_posix() for p in artifact.rglob("*") if p.is_file())
    assert files == ["graph.qir", "kernels/index.json", f"kernels/{KERNEL}.py", "manifest.json", "model.safetensors"]
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["versions"]["packing_layout"] == ["mixprec/v1"]
    assert manifest["versions"]["required_kernels"] == [KERNEL]
    (entry,) = json.loads((artifact / "kernels/index.json").read_text())["kernels"]
    assert entry["kind"] == "mixprec"
    assert entry["key"] == {"act": "f32", "out": "f32", "group": 64, "group2": 64, "bias": False, "outliers": True}
    assert len(entry["weights"]) == 14
    assert sorted(entry["aot"]["targets"]) == ["sm_80", "sm_90"]
    decode = entry["admission"][f"triton.{KERNEL}.decode"]
    assert (decode["families"], decode["codes"], decode["scale_dtypes"]) == (["mixprec"], ["u4"], ["quantized"])
    assert (decode["layouts"], decode["groups"], decode["min_capability"]) == (["mixprec/v1"], [64], 8.0)
    assert "high plane reordered" in decode["repack"]
    opened = get_backend("triton").open(artifact, manifest)
    sizes = {e.name: e.nbytes for e in opened.entries}
    (q,) = [t for t in manifest["rate_ledger"]["tensors"] if t["tensor"] == "model.layers.0.self_attn.q_proj.weight"]
    streams = [n for n in sizes if n.startswith("model.layers.0.self_attn.q_proj.weight.")]
    assert len(streams) == 10  # planes, zero, scale codes / scale2 / zero2, wide, wide_rows, rowptr, col, value
    assert q["stored_bits"] == 8 * sum(sizes[n] for n in streams)  # the ledger counts every stream


def test_the_reader_regenerates_the_source_and_refuses_another(artifact: Path, tmp_path: Path) -> None:
    a = tmp_path / "a"
    shutil.copytree(artifact, a)
    src = a / "kernels" / f"{KERNEL}.py"
    src.write_text(src.read_text().replace("acc += xo", "acc -= xo"))
    with pytest.raises(ArtifactError, match=r"is not the source codegen v1 writes for mixprec key") as e:
        get_backend("triton").open(a, None)
    assert e.value.file == f"kernels/{KERNEL}.py"
    shutil.copy(artifact / "kernels" / f"{KERNEL}.py", src)
    index = json.loads((a / "kernels/index.json").read_text())
    bad = KERNEL.replace("g64_", "g40_", 1)  # a consistent entry for a key no codegen writes: the reader names why
    index["kernels"][0] |= {"id": bad, "source": f"kernels/{bad}.py"}
    index["kernels"][0]["key"]["group"] = 40
    (a / "kernels/index.json").write_text(json.dumps(index))
    src.rename(a / "kernels" / f"{bad}.py")
    with pytest.raises(ArtifactError, match="multiple of 16"):
        get_backend("triton").open(a, None)
    index["kernels"][0]["kind"] = "sparse"
    (a / "kernels/index.json").write_text(json.dumps(index))
    with pytest.raises(ArtifactError, match="unknown kernel kind"):
        get_backend("triton").open(a, None)


def run_json(artifact: Path, device: str) -> dict[str, object]:
    args = ("run", str(artifact), "--tokens", PROMPT, "--max-new-tokens", "8", "--fallback", "forbid")
    r = run_cli(*args, "--device", device, "--json")
    assert r.code == 0, r.err
    return json.loads(r.out)


def test_run_on_the_interpreter_dispatches_every_linear_and_decodes_like_the_cpu_kernel(artifact: Path) -> None:
    ours = run_json(artifact, "interpret")
    assert ours["kernels"] == {"prefill": [f"triton.{KERNEL}.prefill"], "decode": [f"triton.{KERNEL}.decode"]}
    trace = ours["trace"]
    assert isinstance(trace, list)
    assert len(trace) == 28
    assert {d["selected"] for d in trace} == {f"triton.{KERNEL}.prefill", f"triton.{KERNEL}.decode"}
    assert all(d["selected"].endswith(d["phase"]) and d["repack"] for d in trace)
    memory = ours["memory_bytes"]
    assert isinstance(memory, dict)
    assert memory["repack_buffers"] > 0
    ref = run_json(artifact, "cpu")
    assert ref["kernels"] == {"prefill": ["cpu.mixprec"], "decode": ["cpu.mixprec"]}
    assert ours["generated"] == ref["generated"]
    top, ref_top = ours["logits"]["top5"], ref["logits"]["top5"]  # type: ignore[index]
    assert [i for i, _ in top] == [i for i, _ in ref_top]
    assert max(abs(a - b) for (_, a), (_, b) in zip(top, ref_top, strict=True)) < 1e-4


def test_verify_reports_the_mixprec_kernels_interpreter_parity(artifact: Path) -> None:
    r = run_cli("verify", str(artifact), "--json")
    assert r.code == 0, r.out + r.err
    (k,) = json.loads(r.out)["dispatch"]["kernels"]
    assert (k["kernel"], k["kind"], k["aot"]) == (KERNEL, "mixprec", ["sm_80", "sm_90"])
    rows = {c["function"].removeprefix(f"{KERNEL}."): c for c in k["interpreter"]}
    assert sorted(rows) == ["decode[M=1]", "decode[M=5]", "prefill[M=7]"]
    assert all(c["ok"] and c["rel_kernel"] < 1e-5 and c["bound"] == 1e-4 for c in rows.values())


def test_admission_refuses_by_name_on_a_device_with_too_little_shared_memory(artifact: Path) -> None:
    opened = get_backend("triton").open(artifact, None)
    get_backend("triton").runtime_kernels(opened)
    op, w, t = next(iter(quantized_ops(opened.module.graphs[0])))
    place = resolve_place("interpret")
    ok = decide(op, w, t, "decode", place, "auto")
    assert ok.selected == f"triton.{KERNEL}.decode"
    small = dataclasses.replace(place, limits=DeviceLimits(48 * 1024))
    d = decide(op, w, t, "decode", small, "auto")
    why = {k: reason for k, accepted, reason in d.candidates if not accepted}[f"triton.{KERNEL}.decode"]
    assert "bytes of shared memory exceed the device's 49152" in why
    assert d.selected != f"triton.{KERNEL}.decode"
    unlimited = dataclasses.replace(place, limits=None)
    d = decide(op, w, t, "decode", unlimited, "auto")
    reasons = {k: reason for k, _, reason in d.candidates}
    assert "no shared memory and register limits" in reasons[f"triton.{KERNEL}.decode"]


def test_a_weight_the_kernel_cannot_run_is_a_conversion_with_its_reason(artifact: Path) -> None:
    opened = get_backend("triton").open(artifact, None)
    _, _, t = next(iter(quantized_ops(opened.module.graphs[0])))
    assert plan("w", t).kind == "exact"
    scale = t.qparam("scale")
    assert isinstance(scale, QuantType)
    s2 = scale.qparam("scale")
    assert isinstance(s2, DenseType)
    f32 = dataclasses.replace(s2, dtype=DTYPES["f32"])
    nested = dataclasses.replace(scale, qparams=tuple((n, f32 if n == "scale" else v) for n, v in scale.qparams))
    wide_s2 = dataclasses.replace(t, qparams=tuple((n, nested if n == "scale" else v) for n, v in t.qparams))
    p = plan("w", wide_s2)
    assert (p.kind, p.reason) == ("conversion", "a second-level scale in f16")
    dense = dataclasses.replace(t, qparams=tuple((n, f32 if n == "scale" else v) for n, v in t.qparams))
    assert "second-level quantized" in plan("w", dense).reason
