"""The files ONNX runtimes read besides the graphs: carried, derived, bound and checked.

Tiny random causal LMs saved by ``save_pretrained`` with a byte-level BPE tokenizer
(``PreTrainedTokenizerFast``), compiled to onnx-nbits (w4-g32). onnxruntime-genai opens the artifact
as it is (``og.Model(DIR)``, ``og.Tokenizer``), and its greedy tokens equal (a) greedy decoding
through onnxruntime with the decoder graph's own KV cache and (b) transformers' greedy ``generate``
on the model holding the artifact's own decode. ``verify`` passes, and refuses a changed byte of any
runtime file, or a genai_config.json / config.json that disagrees with the graph even when the
manifest is re-hashed, naming the file and field.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from onnx_peers import (
    FULL,
    KV,
    PROMPT,
    SIZES,
    STEPS,
    genai_tokens,
    onnxruntime_tokens,
    source,
    tokenizer,
    transformers_tokens,
)
from prequant_packers import compile_to

from qcompiler.artifact.manifest import files_sha256
from qcompiler.artifact.reader import ArtifactError, open_artifact
from qcompiler.artifact.writer import SELF_DIGEST, manifest_digest
from qcompiler.backends.onnx.genai import DECODER_FILE, GENAI_TYPES
from qcompiler.testing import run_cli


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (source directory, onnx-nbits artifact)."""
    out: dict[str, tuple[Path, Path]] = {}
    for family in FULL:
        root = tmp_path_factory.mktemp(family)
        src = source(root / "src", family)
        assert compile_to(src, "onnx-nbits", root / "art", "--scheme", "w4-g32").code == 0
        out[family] = (src, root / "art")
    return out


def assert_genai_tokens(src: Path, art: Path) -> None:
    ids, got = genai_tokens(art)
    assert ids == tokenizer()(PROMPT)["input_ids"]
    assert len(got) == STEPS
    assert got == onnxruntime_tokens(art, ids, STEPS)
    assert got == transformers_tokens(src, art, ids, STEPS)


@pytest.mark.parametrize("family", FULL)
def test_onnxruntime_genai_runs_the_artifact_as_it_is(compiled: dict[str, tuple[Path, Path]], family: str) -> None:
    assert_genai_tokens(*compiled[family])


@pytest.mark.parametrize(
    "family", ["mistral", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen3_moe"]
)
def test_every_genai_type_of_the_table_runs(tmp_path: Path, family: str) -> None:
    """Each other family of ``genai.GENAI_TYPES``: genai's tokens are onnxruntime's and transformers'
    (Gemma2 and Gemma3 with a sliding window of 6, shorter than the prompt and its 12 tokens; the
    mixtures of experts as genai's generic ``decoder``)."""
    src = source(tmp_path / "src", family)
    assert compile_to(src, "onnx-nbits", tmp_path / "art", "--scheme", "w4-g32").code == 0
    doc = json.loads((tmp_path / "art" / "genai_config.json").read_text())
    assert doc["model"]["type"] == GENAI_TYPES[family]
    assert_genai_tokens(src, tmp_path / "art")


def test_a_family_genai_cannot_run_gets_no_genai_config_and_a_derived_generation_config(tmp_path: Path) -> None:
    """GPT-2 (no genai model type in the table) from a source without generation_config.json: the
    artifact derives one from config.json's token ids, writes no genai_config.json, and the manifest
    says so."""
    tok, src = tokenizer(), tmp_path / "src"
    torch.manual_seed(0)
    ids = {k: SIZES[k] for k in ("bos_token_id", "eos_token_id")}
    cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=64, **ids)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(src)
    tok.save_pretrained(src)
    (src / "generation_config.json").unlink()
    art = tmp_path / "art"
    assert compile_to(src, "onnx-nbits", art, "--scheme", "w4-g32").code == 0
    assert not (art / "genai_config.json").exists()
    manifest = json.loads((art / "manifest.json").read_text())
    package = manifest["provenance"]["package"]
    assert package["carried"] == ["tokenizer.json", "tokenizer_config.json"]
    assert package["derived"] == ["config.json", "generation_config.json"]
    assert package["genai"]["model_type"] is None
    assert "gpt2" in package["genai"]["reason"]
    generation = transformers.GenerationConfig.from_pretrained(art)
    assert (generation.bos_token_id, generation.eos_token_id) == (SIZES["bos_token_id"], SIZES["eos_token_id"])
    names = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert manifest["tokenizer_sha256"] == files_sha256({n: (art / n).read_bytes() for n in names})
    assert run_cli("verify", str(art)).code == 0
    edit_json(art, "generation_config.json", ["eos_token_id"], 5)  # a derived file is what config.json says
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert e.value.file == "generation_config.json", str(e.value)


def test_verify_passes_and_the_manifest_says_what_is_carried(compiled: dict[str, tuple[Path, Path]]) -> None:
    src, art = compiled["llama"]
    assert run_cli("verify", str(art)).code == 0
    opened = open_artifact(art)
    assert "package" in opened.gates
    manifest = json.loads((art / "manifest.json").read_text())
    carried = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert manifest["provenance"]["package"] == {
        "carried": carried,
        "derived": ["config.json", "genai_config.json"],
        "genai": {"model_type": "llama"},
    }
    for name in carried:
        assert (art / name).read_bytes() == (src / name).read_bytes()
    assert manifest["tokenizer_sha256"] == files_sha256({n: (src / n).read_bytes() for n in carried})
    config = json.loads((art / "config.json").read_text())
    assert config == json.loads((src / "config.json").read_text())
    assert transformers.AutoConfig.from_pretrained(art).num_key_value_heads == 2


def copy(art: Path, tmp: Path) -> Path:
    out = tmp / "art"
    shutil.copytree(art, out)
    return out


def rehash(art: Path, name: str) -> None:
    """Record ``name``'s new size and sha256 in the manifest, as a tool that edits files would."""
    data = (art / name).read_bytes()
    manifest = json.loads((art / "manifest.json").read_text())
    entry = next(e for e in manifest["files"] if e["path"] == name)
    entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest[SELF_DIGEST] = manifest_digest(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["genai_config.json", "config.json", "tokenizer.json"])
def test_a_changed_byte_is_refused_naming_the_file(
    compiled: dict[str, tuple[Path, Path]], tmp_path: Path, name: str
) -> None:
    art = copy(compiled["llama"][1], tmp_path)
    data = bytearray((art / name).read_bytes())
    at = data.index(b":")
    data[at + 1 : at + 2] = b"\t"  # still the same JSON, another byte
    (art / name).write_bytes(bytes(data))
    r = run_cli("verify", str(art), "--json")
    assert r.code == 1
    assert name in json.loads(r.out)["error"]
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert (e.value.file, e.value.field) == (name, "sha256")
    rehash(art, name)  # re-hashed: graph.qir's record still holds the byte the writer wrote
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert (e.value.file, e.value.field) == (name, "sha256"), str(e.value)


def edit_json(art: Path, name: str, path: list[str], value: Any) -> None:
    doc = json.loads((art / name).read_text())
    at = doc
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = value
    (art / name).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    rehash(art, name)


@pytest.mark.parametrize(
    ("name", "path", "value", "field", "expected"),
    [
        ("genai_config.json", ["model", "decoder", "num_key_value_heads"], 4, "model.decoder.num_key_value_heads", KV),
        ("genai_config.json", ["model", "decoder", "filename"], "other.onnx", "model.decoder.filename", DECODER_FILE),
        ("genai_config.json", ["model", "vocab_size"], 1000, "model.vocab_size", len(tokenizer())),
        ("config.json", ["num_hidden_layers"], 3, "num_hidden_layers", SIZES["num_hidden_layers"]),
        ("config.json", ["num_key_value_heads"], 4, "num_key_value_heads", KV),
    ],
)
def test_a_rehashed_file_that_disagrees_with_the_graph_is_refused_naming_the_field(
    compiled: dict[str, tuple[Path, Path]],
    tmp_path: Path,
    name: str,
    path: list[str],
    value: Any,
    field: str,
    expected: Any,
) -> None:
    art = copy(compiled["llama"][1], tmp_path)
    edit_json(art, name, path, value)
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert (e.value.file, e.value.field, e.value.expected, e.value.found) == (name, field, expected, value), str(
        e.value
    )
    r = run_cli("verify", str(art), "--json")
    assert r.code == 1
    assert field in json.loads(r.out)["error"]


def test_a_runtime_file_nothing_binds_is_refused(compiled: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """A ``vocab.json`` slipped in and listed in the manifest (its hash, ``tokenizer_sha256`` and
    the manifest's own digest all recomputed): graph.qir's record does not list it."""
    art = copy(compiled["llama"][1], tmp_path)
    data = json.dumps({"a": 0}).encode()
    (art / "vocab.json").write_bytes(data)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"].append({"path": "vocab.json", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    names = ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    manifest["tokenizer_sha256"] = files_sha256({n: (art / n).read_bytes() for n in names})
    manifest[SELF_DIGEST] = manifest_digest(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError) as e:
        open_artifact(art)
    assert e.value.file == "vocab.json", str(e.value)
    assert "nothing binds" in e.value.message
