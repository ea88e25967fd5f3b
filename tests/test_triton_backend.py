"""``--target triton`` end to end: the artifact holds the weights in ``triton-kn`` and the generated
kernels; the reader regenerates each kernel and refuses any other text; ``verify`` on a machine
without CUDA says the kernels need it and still checks everything (kernels on the interpreter);
``load(device="interpret")`` dispatches every quantized linear to the generated kernels and decodes
exactly like the CPU kernels and the reference graph; ``load(device="cuda")`` without CUDA is refused."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

import qcompiler
from qcompiler.artifact.reader import ArtifactError
from qcompiler.backends import get_backend
from qcompiler.errors import UsageError
from qcompiler.ir.interpret import run_graph
from qcompiler.runtime import LoadError, Session
from qcompiler.runtime.load import kernel
from qcompiler.testing import gptq_module, run_cli, shuffled_act_order

LLAMA = "qcompiler.examples:tiny_llama_hf"
PROMPT = [[5, 17, 99, 3], [3, 99, 17, 5]]
KERNEL = "qlinear_i4_g32_sym_af32_sf32_of32"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("triton") / "w4"
    r = run_cli("compile", LLAMA, "--scheme", "w4-g32", "--target", "triton", "-o", str(out))
    assert r.code == 0, r.err
    return out


def copy(artifact: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "a"
    shutil.copytree(artifact, dst)
    return dst


def test_the_artifact_holds_codes_in_the_kernel_layout_and_the_generated_kernels(artifact: Path) -> None:
    files = sorted(p.relative_to(artifact).as_posix() for p in artifact.rglob("*") if p.is_file())
    assert files == ["graph.qir", "kernels/index.json", f"kernels/{KERNEL}.py", "manifest.json", "model.safetensors"]
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["target"] == "triton"
    assert manifest["versions"]["required_kernels"] == [KERNEL]
    assert manifest["versions"]["packing_layout"] == ["triton-kn/v1"]
    index = json.loads((artifact / "kernels/index.json").read_text())
    (entry,) = index["kernels"]
    assert len(entry["weights"]) == 14
    assert sorted(entry["aot"]["targets"]) == ["sm_80", "sm_90"]
    assert set(entry["functions"]) == {"decode", "reduce", "prefill"}
    decode = entry["admission"][f"triton.{KERNEL}.decode"]  # the signature each kernel accepts
    assert decode["phases"] == ["decode"]
    assert decode["layouts"] == ["triton-kn/v1"]
    assert (decode["codes"], decode["groups"], decode["activations"]) == (["i4"], [32], ["f32"])
    assert decode["min_capability"] == 8.0
    info = qcompiler.load(artifact, device="cpu").opened.entries
    codes = next(e for e in info if e.name == "model.layers.0.mlp.up_proj.weight.codes")
    assert (codes.dtype, codes.shape) == ("U8", (32, 128))  # [K/2, N] for K=64, N=128


def test_verify_without_cuda_says_the_kernels_need_it_and_checks_them_on_the_interpreter(artifact: Path) -> None:
    r = run_cli("verify", str(artifact), "--json")
    assert r.code == 0, r.out + r.err
    out = json.loads(r.out)
    assert out["gates"] == ["manifest", "files", "container", "kernels", "graph", "derived"]
    dispatch = out["dispatch"]
    if not torch.cuda.is_available():
        assert "need CUDA capability >= 8.0" in dispatch["cuda"]
    (k,) = dispatch["kernels"]
    assert k["aot"] == ["sm_80", "sm_90"]
    assert {c["function"].split(".")[-1].partition("[")[0] for c in k["interpreter"]} == {"decode", "prefill"}
    assert all(c["rel_kernel"] < 1e-6 for c in k["interpreter"])


def test_interpret_device_dispatches_to_the_generated_kernels_and_decodes_like_the_reference(artifact: Path) -> None:
    lm = qcompiler.load(artifact, device="interpret", fallback="forbid")
    chosen = Counter((d.phase, d.selected) for d in lm.decisions)
    assert chosen == {("prefill", f"triton.{KERNEL}.prefill"): 14, ("decode", f"triton.{KERNEL}.decode"): 14}
    d = lm.decision("model.layers.0.mlp.up_proj.weight", "decode")
    rejected = {k: why for k, ok, why in d.candidates if not ok}
    assert rejected["cpu.int4pack"] == "runs on cpu, not cuda"
    assert rejected[f"triton.{KERNEL}.prefill"] == "phase decode not in ['prefill']"
    assert lm.memory["repack_buffers"] == 0  # the codes are read as stored
    session = Session(lm)
    tokens, steps = session.generate(PROMPT, 6)
    assert session.kernels_used == {"prefill": {f"triton.{KERNEL}.prefill"}, "decode": {f"triton.{KERNEL}.decode"}}
    cpu_tokens, cpu_steps = Session(qcompiler.load(artifact, device="cpu")).generate(PROMPT, 6)
    assert tokens == cpu_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(steps, cpu_steps, strict=True)) < 1e-4
    ref = run_graph(lm.module, [torch.tensor(PROMPT)], lm.graph.name)[0]
    first = Session(lm).step(torch.tensor(PROMPT))
    assert float((first - ref).norm() / ref.norm()) < 1e-5


def test_cpu_load_states_the_kernels_need_cuda_and_runs_the_cpu_kernels(artifact: Path) -> None:
    lm = qcompiler.load(artifact, device="cpu")
    d = lm.decision("model.layers.0.self_attn.q_proj.weight", "prefill")
    assert d.selected == "cpu.int4pack"
    assert (f"triton.{KERNEL}.prefill", False, "runs on cuda, not cpu") in d.candidates
    if not torch.cuda.is_available():
        with pytest.raises(LoadError, match=r"no CUDA device.*1 generated kernel\(s\) need CUDA capability >= 8.0"):
            qcompiler.load(artifact, device="cuda")


def test_run_cli_on_the_interpreter(artifact: Path) -> None:
    r = run_cli(
        "run", str(artifact), "--tokens", "5,17,99,3", "--max-new-tokens", "3", "--device", "interpret", "--json"
    )
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["kernels"] == {"prefill": [f"triton.{KERNEL}.prefill"], "decode": [f"triton.{KERNEL}.decode"]}
    assert len(out["generated"]) == 3


def test_a_kernel_source_that_is_not_the_codegens_is_refused(artifact: Path, tmp_path: Path) -> None:
    a = copy(artifact, tmp_path)
    src = a / "kernels" / f"{KERNEL}.py"
    src.write_text(src.read_text().replace("acc += tl.dot", "acc -= tl.dot"))
    with pytest.raises(ArtifactError, match=r"kernels/.*\.py.*is not the source codegen v1 writes") as e:
        get_backend("triton").open(a, None)
    assert e.value.file == f"kernels/{KERNEL}.py"


@pytest.mark.parametrize(
    ("where", "value", "field"),
    [
        (("key", "bits"), 3, "kernels[0].key.bits"),
        (("key", "act"), "f64", "kernels[0].key.act"),
        (("id",), "other", "kernels[0].id"),
        (("source",), "../../etc/passwd", "kernels[0].source"),
        (("functions", "decode", "launch", "BLOCK_N"), 4096, "kernels[0].functions"),
        (("key", "zero"), True, "kernels[0].id"),  # a key other than the file's
        (("admission", f"triton.{KERNEL}.decode", "min_capability"), 7.0, "kernels[0].admission"),
    ],
)
def test_index_entries_are_checked_field_by_field(
    artifact: Path, tmp_path: Path, where: tuple[str, ...], value: object, field: str
) -> None:
    a = copy(artifact, tmp_path)
    path = a / "kernels" / "index.json"
    index = json.loads(path.read_text())
    node = index["kernels"][0]
    for part in where[:-1]:
        node = node[part]
    node[where[-1]] = value
    path.write_text(json.dumps(index))
    with pytest.raises(ArtifactError) as e:
        get_backend("triton").open(a, None)
    assert e.value.field == field


def test_extra_files_and_missing_kernels_are_refused(artifact: Path, tmp_path: Path) -> None:
    a = copy(artifact, tmp_path)
    (a / "kernels" / "extra.py").write_text("print('hi')\n")
    with pytest.raises(ArtifactError, match="does not list") as e:
        get_backend("triton").open(a, None)
    assert e.value.file == "kernels/extra.py"
    b = copy(artifact, tmp_path / "b")
    path = b / "kernels" / "index.json"
    index = json.loads(path.read_text())
    index["kernels"] = []
    path.write_text(json.dumps(index))
    (b / "kernels" / f"{KERNEL}.py").unlink()
    with pytest.raises(ArtifactError, match="missing or unused"):
        get_backend("triton").open(b, None)


def test_an_fp16_model_runs_the_fp16_kernels_through_runtime_rungs_4_and_5(tmp_path: Path) -> None:
    out = tmp_path / "f16"
    r = run_cli(
        "compile", "qcompiler.examples:tiny_llama_f16_hf", "--scheme", "w4-g32", "--target", "triton", "-o", str(out)
    )
    assert r.code == 0, r.err
    r = run_cli("verify", str(out), "--level", "5", "--device", "interpret", "--json")
    assert r.code == 0, r.out + r.err
    result = json.loads(r.out)
    rung4, rung5 = result["rungs"]["4_graph_logits"], result["rungs"]["5_dispatch_resources"]
    assert rung4["greedy_equal"]
    assert rung4["kernel_bound"] == 3e-3  # the fp16 kernels' stated bound
    assert rung5["kernels"] == [
        "triton.qlinear_i4_g32_sym_af16_sf32_of16.decode",
        "triton.qlinear_i4_g32_sym_af16_sf32_of16.prefill",
    ]
    assert rung5["fallbacks"] == 0


def test_a_bf16_model_compiles_and_says_where_its_kernels_can_run(tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    r = run_cli(
        "compile", "qcompiler.examples:tiny_llama_bf16_hf", "--scheme", "w4-g32", "--target", "triton", "-o", str(out)
    )
    assert r.code == 0, r.err
    r = run_cli("verify", str(out), "--json")
    assert r.code == 0, r.out + r.err
    (k,) = json.loads(r.out)["dispatch"]["kernels"]
    assert k["kernel"] == "qlinear_i4_g32_sym_abf16_sf32_obf16"
    assert k["aot"] == ["sm_80", "sm_90"]
    assert k["interpreter"] == []
    assert "not run on the interpreter" in k["note"]
    with pytest.raises(UsageError, match="bf16 kernels run on a CUDA device only"):
        qcompiler.load(out, device="interpret")


def test_a_quantized_embedding_runs_the_gather_kernel(tmp_path: Path) -> None:
    out = tmp_path / "emb"
    r = run_cli("compile", LLAMA, "--scheme", "w4-g32", "--embeddings", "--target", "triton", "-o", str(out))
    assert r.code == 0, r.err
    for device, gather in (
        ("interpret", "triton.qembedding_i4_g32_sym_af32_sf32_of32.gather"),
        ("cpu", "cpu.embedding-rows"),
    ):
        r = run_cli("verify", str(out), "--level", "5", "--device", device, "--json")
        assert r.code == 0, r.out + r.err
        rungs = json.loads(r.out)["rungs"]
        assert gather in rungs["5_dispatch_resources"]["kernels"]
        assert rungs["4_graph_logits"]["greedy_equal"]


def test_a_gptq_act_order_weight_runs_through_the_permutation(tmp_path: Path) -> None:
    import numpy as np

    from qcompiler.artifact.request import ArtifactRequest
    from qcompiler.passes.base import PassContext
    from qcompiler.passes.manager import PassManager
    from qcompiler.passes.spec import parse_pipeline

    m, effective = gptq_module(shuffled_act_order(64, 16), n=32, group=16)
    spec = "freeze-semantics,canonicalize-axes,place-shards{target=triton},pack-layouts,fuse-qdq,emit-container"
    PassManager(parse_pipeline(spec)).run(m, PassContext(artifact=ArtifactRequest(tmp_path / "gptq")))
    index = json.loads((tmp_path / "gptq" / "kernels" / "index.json").read_text())
    assert [e["id"] for e in index["kernels"]] == ["qlinear_i4_g16_asym_perm_af32_sf32_of32"]
    lm = qcompiler.load(tmp_path / "gptq", device="interpret")
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32))
    want = x.double() @ torch.from_numpy(effective).double().T
    session = Session(lm)
    y = session.run([x])[0]  # not a causal LM: every step is a prefill
    assert session.kernels_used == {"prefill": {"triton.qlinear_i4_g16_asym_perm_af32_sf32_of32.prefill"}}
    assert float((y.double() - want).norm() / want.norm()) < 1e-6
    d = lm.decision("w", "decode")  # the decode kernel (split-K) on the same prepared weight
    assert d.selected == "triton.qlinear_i4_g16_asym_perm_af32_sf32_of32.decode"
    run = kernel(d.selected).run
    assert run is not None
    y1 = run(lm.handles[("w", d.selected)], x[:1], None)
    assert float((y1.double() - want[:1]).norm() / want[:1].norm()) < 1e-6


def test_weights_the_kernels_cannot_run_are_a_conversion(tmp_path: Path) -> None:
    r = run_cli("compile", LLAMA, "--scheme", "q5_0", "--target", "triton", "-o", str(tmp_path / "k"))
    assert r.code != 0
    assert "the kernels read 2, 4 or 8-bit codes, not 5" in r.err
    assert "--allow-conversion" in r.err
