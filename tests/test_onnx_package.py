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
import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from prequant_packers import artifact_decodes, compile_to
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qcompiler.artifact.manifest import files_sha256
from qcompiler.artifact.reader import ArtifactError, open_artifact
from qcompiler.artifact.writer import SELF_DIGEST, manifest_digest
from qcompiler.backends.onnx.genai import DECODER_FILE, GENAI_TYPES
from qcompiler.quant.experts import unfuse_experts
from qcompiler.testing import run_cli

PROMPT = "the quick brown fox"
STEPS = 12
TEXT = ["the quick brown fox jumps over the lazy dog, hello world"] * 20
SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
KV = SIZES["num_key_value_heads"]
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {"tie_word_embeddings": False}),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {}),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, {"sliding_window": None}),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, {"head_dim": 32}),
    "gemma": (transformers.GemmaForCausalLM, transformers.GemmaConfig, {"head_dim": 16}),
    "gemma2": (
        transformers.Gemma2ForCausalLM,
        transformers.Gemma2Config,
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6},
    ),
    "gemma3_text": (
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig,
        {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6},
    ),
    "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config, {"pad_token_id": 1}),
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig, {"num_local_experts": 4}),
    "qwen3_moe": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig,
        {"head_dim": 32, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2},
    ),
}
"""model_type -> (model class, config class, fixed config values)."""
FULL = ("llama", "qwen2")
"""The families the module's artifact fixture compiles (every check runs on llama)."""


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def source(root: Path, family: str, seed: int = 0, **over: Any) -> Path:
    """A ``save_pretrained`` directory of a tiny ``family`` model with its tokenizer."""
    model_cls, config_cls, fixed = FAMILIES[family]
    tok = tokenizer()
    torch.manual_seed(seed)
    model = model_cls(config_cls(vocab_size=len(tok), **{**SIZES, **fixed, **over})).eval()
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return root


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


def genai_tokens(art: Path) -> tuple[list[int], list[int]]:
    """The prompt as og.Tokenizer encodes it, and og.Generator's greedy tokens after it."""
    og: Any = importlib.import_module("onnxruntime_genai")  # ships no type stubs
    model = og.Model(str(art))
    ids = [int(t) for t in og.Tokenizer(model).encode(PROMPT)]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + STEPS)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    out: list[int] = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return ids, out


def onnxruntime_tokens(art: Path, ids: list[int], steps: int) -> list[int]:
    """Greedy decoding through onnxruntime with the decoder graph: every input it declares is fed
    (``attention_mask`` and ``position_ids`` when it has them), the cache from its own presents."""
    import onnxruntime as ort

    from qcompiler.backends.onnx.dispatch import session_options

    sess = ort.InferenceSession(str(art / DECODER_FILE), sess_options=session_options(1))
    out_names = [o.name for o in sess.get_outputs()]
    cache = {
        i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
        for i in sess.get_inputs()
        if i.name.startswith("past_key_values.")
    }
    feed, past, tokens = list(ids), 0, []
    for _ in range(steps):
        inputs: dict[str, Any] = {
            "input_ids": np.array([feed], np.int64),
            "attention_mask": np.ones((1, past + len(feed)), np.int64),
            "position_ids": np.arange(past, past + len(feed), dtype=np.int64)[None],
            **cache,
        }
        res: dict[str, Any] = dict(
            zip(out_names, sess.run(None, {i.name: inputs[i.name] for i in sess.get_inputs()}), strict=True)
        )
        tokens.append(int(np.argmax(res["logits"][0, -1])))
        past += len(feed)
        feed = tokens[-1:]
        cache = {k.replace("present.", "past_key_values."): v for k, v in res.items() if k.startswith("present.")}
    return tokens


def transformers_tokens(src: Path, art: Path, ids: list[int], steps: int) -> list[int]:
    """transformers' greedy ``generate`` on the model whose Linear weights are the artifact's decode."""
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model = unfuse_experts(model)  # a mixture's experts under the checkpoint's own names, as captured
    for name, values in artifact_decodes(art).items():
        model.get_parameter(name).data = torch.from_numpy(values.astype(np.float32))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
    return [int(t) for t in out[0, len(ids) :]]


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
