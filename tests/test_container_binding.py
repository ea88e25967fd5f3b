"""Every byte a consumer reads is bound by ``graph.qir`` and checked by meaning. Each corruption below
edits one container file and re-hashes the manifest (sha256s prove identity, not origin), so only the
readers' binding gates can notice: safetensors header entries against the IR's declarations, tensors
nothing references, ``__metadata__``, GGUF metadata and config.json hyperparameters against the facts
the graph computes (``qcompiler.ir.facts``), and everything else against the writer's sha256 record.
For some of them llama.cpp or transformers is run on the corrupted file, to show the gate matters."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qcompiler.artifact.reader import ArtifactError, open_artifact
from qcompiler.backends.gguf.blobs import part_of
from qcompiler.backends.gguf.reader import open_gguf
from qcompiler.backends.gguf.writer import KV, GGUFValueType, TensorPayload, serialize
from qcompiler.backends.safetensors.container import open_file
from qcompiler.backends.safetensors.container_write import TensorBytes
from qcompiler.backends.safetensors.container_write import serialize as serialize_st
from qcompiler.errors import BlobError
from qcompiler.ir.facts import model_facts
from qcompiler.testing import rehash, run_cli

TINY = "qcompiler.examples:tiny_llama_hf"


# --------------------------------------------------------------------------- helpers


def refusal(path: Path) -> str:
    """The error ``qcompiler verify`` reports (it must refuse, with a typed error)."""
    r = run_cli("verify", str(path), "--json")
    result = json.loads(r.out)
    assert r.code == 1, result
    assert result["ok"] is False
    error = str(result["error"])
    assert "internal error" not in error, error
    return error


def corrupted(src: Path, tmp_path: Path, edit: Callable[[Path], None]) -> Path:
    out = tmp_path / "art"
    shutil.copytree(src, out)
    edit(out)
    rehash(out)
    return out


def edit_header(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change a safetensors header in place (padded to its old length): the tensor bytes stay as they are."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    change(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    path.write_bytes(data[:8] + raw + b" " * (n - len(raw)) + data[8 + n :])


def add_tensor(path: Path, name: str) -> None:
    """Rewrite a safetensors file with one more (small, well-formed) tensor."""
    f = open_file(path)
    tensors = [TensorBytes(e.name, e.dtype, e.shape, f.read(e.name)) for e in f.tensors.values()]
    tensors.append(TensorBytes(name, "F32", (4,), b"\0" * 16))
    path.write_bytes(b"".join(serialize_st(tensors, f.metadata)))


def rewrite_gguf(path: Path, values: dict[str, Any]) -> None:
    """Rewrite ``model.gguf`` with some metadata values replaced (same keys, same types)."""
    f = open_gguf(path / "model.gguf")
    kvs = []
    for key, (vtype, value) in f.metadata.items():
        elem = GGUFValueType(f.array_types[key]) if key in f.array_types else None
        kvs.append(KV(key, GGUFValueType(vtype), values.get(key, value), elem))
    tensors = [TensorPayload(n, i.shape, i.type_id, f.read(n)) for n, i in f.tensors.items()]
    (path / "model.gguf").write_bytes(b"".join(serialize(kvs, tensors)))


def edit_json(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def compile_ok(src: str, out: Path, *args: str) -> Path:
    r = run_cli("compile", src, "-o", str(out), *args)
    assert r.code == 0, r.err
    return out


def llama_dir(root: Path) -> Path:
    """A tiny Llama checkpoint directory with a byte-level BPE tokenizer (bos 0, eos 1)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, hello world"] * 20, trainer)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(root)
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_dir(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def ct(tmp_path_factory: pytest.TempPathFactory, source: Path) -> Path:
    out = tmp_path_factory.mktemp("ct") / "art"
    return compile_ok(str(source), out, "--scheme", "w4-g32", "--target", "safetensors")


@pytest.fixture(scope="module")
def gguf_art(tmp_path_factory: pytest.TempPathFactory, source: Path) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "art"
    return compile_ok(str(source), out, "--scheme", "q4_0", "--target", "gguf")


@pytest.fixture(scope="module")
def triton_art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("triton") / "art"
    return compile_ok(TINY, out, "--scheme", "w4-g32", "--target", "triton")


# --------------------------------------------------------------------------- untouched artifacts


def test_untouched_artifacts_verify_and_their_graph_facts_are_the_models(
    ct: Path, gguf_art: Path, triton_art: Path
) -> None:
    for path in (ct, gguf_art, triton_art):
        r = run_cli("verify", str(path), "--json")
        assert r.code == 0, r.out
    facts = model_facts(open_artifact(gguf_art).module)
    assert (facts.hidden, facts.layers, facts.heads, facts.kv_heads, facts.head_dim) == (64, 2, 4, 2, 16)
    assert (facts.ff, facts.act, facts.norm, facts.eps, facts.rotary_dim) == (128, "silu", "rms", 1e-06, 16)
    assert (facts.tied, facts.causal, facts.positions) == (False, True, None)
    assert facts.rope_base is not None
    assert abs(facts.rope_base - 10000.0) < 1e-2


# --------------------------------------------------------------------------- tensor headers and inventory


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [("dtype", "I32", "(expected F32, found I32)"), ("shape", [64, 128], "(expected [128, 64], found [64, 128])")],
)
def test_triton_header_change_with_the_same_bytes_is_refused(
    triton_art: Path, tmp_path: Path, field: str, value: object, expected: str
) -> None:
    def edit(path: Path) -> None:
        edit_header(path / "model.safetensors", lambda h: h["model.embed_tokens.weight"].update({field: value}))

    error = refusal(corrupted(triton_art, tmp_path, edit))
    assert f"model.safetensors: tensor 'model.embed_tokens.weight': {field}: the container header disagrees" in error
    assert expected in error


@pytest.mark.parametrize(("art", "file"), [("triton", "model.safetensors"), ("ct", "graph.safetensors")])
def test_an_unreferenced_extra_tensor_is_refused(
    request: pytest.FixtureRequest, tmp_path: Path, art: str, file: str
) -> None:
    src: Path = request.getfixturevalue("triton_art" if art == "triton" else art)
    error = refusal(corrupted(src, tmp_path, lambda p: add_tensor(p / file, "model.smuggled")))
    assert error.startswith(f"{file}: tensor 'model.smuggled': tensor model.smuggled is in {file} but nothing binds it")


@pytest.mark.parametrize("art", ["ct", "triton"])
def test_safetensors_metadata_change_is_refused(request: pytest.FixtureRequest, tmp_path: Path, art: str) -> None:
    src: Path = request.getfixturevalue("triton_art" if art == "triton" else art)

    def edit(path: Path) -> None:
        edit_header(path / "model.safetensors", lambda h: h["__metadata__"].update(format="np"))

    error = refusal(corrupted(src, tmp_path, edit))
    assert error == (
        "model.safetensors: __metadata__: __metadata__ is not what the writer writes "
        "(expected {'format': 'pt'}, found {'format': 'np'})"
    )


# --------------------------------------------------------------------------- GGUF metadata


GGUF_CASES: list[tuple[str, Any, str]] = [
    ("llama.rope.dimension_count", 1, "disagrees with what graph.qir computes (rotary_dim) (expected 16, found 1)"),
    ("llama.rope.freq_base", 20000.0, "disagrees with what graph.qir computes (inv_freq)"),
    ("llama.attention.layer_norm_rms_epsilon", 1e-5, "disagrees with what graph.qir computes (eps)"),
    ("llama.attention.head_count_kv", 4, "disagrees with what graph.qir computes (kv_heads) (expected 2, found 4)"),
    ("tokenizer.ggml.tokens", None, "key differs from what the writer wrote"),
    ("tokenizer.ggml.bos_token_id", 5, "key differs from what the writer wrote"),
    ("llama.context_length", 4096, "key differs from what the writer wrote"),
]


def gguf_edit(key: str, value: Any) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        new = value
        if value is None:  # token 100's string changed (to one the vocabulary does not hold yet)
            tokens: list[str] = list(open_gguf(path / "model.gguf").metadata[key][1])  # pyright: ignore
            tokens[100] = next(tokens[100] + s for s in ("x", "xx", "xxx", "xxxx") if tokens[100] + s not in tokens)
            new = tokens
        rewrite_gguf(path, {key: new})

    return edit


@pytest.mark.parametrize(("key", "value", "message"), GGUF_CASES)
def test_gguf_metadata_edits_are_refused_by_name(
    gguf_art: Path, tmp_path: Path, key: str, value: Any, message: str
) -> None:
    error = refusal(corrupted(gguf_art, tmp_path, gguf_edit(key, value)))
    assert error.startswith(f"model.gguf: {key}: {message}"), error


def llama_scores(path: Path, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path / "model.gguf"), logits_all=True, n_ctx=64, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def test_the_gguf_corruptions_change_what_llama_cpp_does(gguf_art: Path, tmp_path: Path) -> None:
    """The gates matter: llama.cpp refuses the files whose rope dimension is 1 or whose head_count_kv is 4,
    computes other logits from the file whose rope base was edited, and reads token 100 as another
    string from the file whose vocabulary was edited."""
    from llama_cpp import Llama

    for i, (key, value) in enumerate([("llama.rope.dimension_count", 1), ("llama.attention.head_count_kv", 4)]):
        bad = corrupted(gguf_art, tmp_path / f"refused{i}", gguf_edit(key, value))
        with pytest.raises(ValueError, match="Failed to load model"):
            Llama(model_path=str(bad / "model.gguf"), n_ctx=64, verbose=False)
    ids = [int(i) for i in np.random.default_rng(0).integers(2, 250, 32)]
    rope = corrupted(gguf_art, tmp_path / "rope", gguf_edit("llama.rope.freq_base", 20000.0))
    assert np.abs(llama_scores(rope, ids) - llama_scores(gguf_art, ids)).max() > 1e-3
    tokens = corrupted(gguf_art, tmp_path / "tokens", gguf_edit("tokenizer.ggml.tokens", None))

    def piece(path: Path) -> bytes:
        return Llama(model_path=str(path / "model.gguf"), vocab_only=True, verbose=False).detokenize([100])

    assert piece(tokens) != piece(gguf_art)


# --------------------------------------------------------------------------- config.json and carried files


CONFIG_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("rms_norm_eps", lambda c: c.update(rms_norm_eps=1e-2), "config.json: rms_norm_eps: disagrees with what graph.qir"),
    (
        "rope_theta",
        lambda c: c["rope_parameters"].update(rope_theta=500000.0),
        "config.json: rope_parameters.rope_theta: disagrees with what graph.qir computes (inv_freq)",
    ),
    # the architecture built from the edited config expects another k_proj: the inventory gate says so first
    (
        "num_key_value_heads",
        lambda c: c.update(num_key_value_heads=4),
        "model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight_shape': value: disagrees",
    ),
    ("bos_token_id", lambda c: c.update(bos_token_id=5), "config.json: bos_token_id: key differs from what the writer"),
    ("added key", lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}), "config.json: rope_scaling: key"),
]


@pytest.mark.parametrize(("name", "change", "message"), CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_config_json_edits_are_refused_by_name(
    ct: Path, tmp_path: Path, name: str, change: Callable[[dict[str, Any]], None], message: str
) -> None:
    error = refusal(corrupted(ct, tmp_path, lambda p: edit_json(p / "config.json", change)))
    assert error.startswith(message), error


def test_an_edited_rms_norm_eps_changes_what_transformers_computes(ct: Path, tmp_path: Path) -> None:
    bad = corrupted(ct, tmp_path, lambda p: edit_json(p / "config.json", CONFIG_CASES[0][1]))
    ids = torch.tensor([[0, 5, 17, 42, 99, 150, 7, 3]])
    logits = []
    for path in (ct, bad):
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert (logits[0] - logits[1]).abs().max() > 1e-3


def test_a_carried_tokenizer_file_edit_is_refused(ct: Path, tmp_path: Path) -> None:
    def edit(path: Path) -> None:
        edit_json(path / "tokenizer_config.json", lambda c: c.update(bos_token="</s>"))

    error = refusal(corrupted(ct, tmp_path, edit))
    assert error.startswith("tokenizer_config.json: sha256: file differs from what the writer wrote"), error

    def add(path: Path) -> None:
        (path / "chat_template.jinja").write_text("{{ x }}")

    extra = refusal(corrupted(ct, tmp_path / "extra", add))
    assert extra.startswith("chat_template.jinja: sha256: file 'chat_template.jinja' is in the artifact but nothing"), (
        extra
    )


def test_a_graph_without_its_binding_record_is_refused(gguf_art: Path, tmp_path: Path) -> None:
    def edit(path: Path) -> None:
        text = (path / "graph.qir").read_text()
        start = text.index(", bound = {")
        end = text.index("]]}", start) + 3
        (path / "graph.qir").write_text(text[:start] + text[end:])

    assert "graph.qir records no binding for it" in refusal(corrupted(gguf_art, tmp_path, edit))


# --------------------------------------------------------------------------- untyped exceptions, now typed


def test_a_block_part_of_a_dense_gguf_tensor_is_a_typed_refusal(gguf_art: Path, tmp_path: Path) -> None:
    """``@codes`` of an F32 tensor used to be a ValueError from ``np.concatenate`` (no code fields)."""
    f = open_gguf(gguf_art / "model.gguf")
    with pytest.raises(BlobError, match="part 'codes' needs a block type"):
        part_of(f, "token_embd.weight", "codes")
    with pytest.raises(BlobError, match="part 'values' needs a dense type"):
        part_of(f, "blk.0.attn_q.weight", "values")

    def edit(path: Path) -> None:
        text = (path / "graph.qir").read_text()
        (path / "graph.qir").write_text(text.replace("#token_embd.weight@values", "#token_embd.weight@codes"))

    assert "part 'codes' needs a block type (found F32)" in refusal(corrupted(gguf_art, tmp_path, edit))


@pytest.mark.parametrize("aot", ["x", {"targets": 5, "triton": "3"}, [1]])
def test_malformed_kernel_evidence_is_a_typed_refusal(triton_art: Path, tmp_path: Path, aot: object) -> None:
    """``dispatch.report`` used to call ``.get`` on the index's ``aot`` (an AttributeError on a string)."""

    def edit(path: Path) -> None:
        edit_json(path / "kernels" / "index.json", lambda i: i["kernels"][0].update(aot=aot))

    bad = corrupted(triton_art, tmp_path, edit)
    error = refusal(bad)
    assert error.startswith("kernels/index.json: kernels[0].aot: AOT evidence must be null or"), error
    from qcompiler.backends.triton.read import aot_targets

    with pytest.raises(ArtifactError, match="AOT evidence"):
        aot_targets(bad)
