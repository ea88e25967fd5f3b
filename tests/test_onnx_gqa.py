"""``--onnx-attention gqa``: the decoder graph's attention as onnxruntime's ``GroupQueryAttention``.

Tiny random Llama, Mistral (sliding window 6) and Gemma2 (window 6 on alternate layers, scores
soft-capped at 5 with weights 10x the default scale so the cap bites) saved by ``save_pretrained``
with a byte-level BPE tokenizer, compiled w4-g32 to onnx-nbits in both attention forms. Against the
real peers: the written decoder has one ``GroupQueryAttention`` a layer and no ``Softmax``, and
onnxruntime keeps them after optimising (the dispatch proof); greedy decoding through the cache equals
the artifact's QIR graph and the decomposed artifact; a left-padded batch decodes each row as alone;
onnxruntime-genai runs it with shared past/present buffers and generates transformers' tokens; the
reader refuses an edited node attribute or attention form, naming file and field.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx_peers import (
    GRAPH_PROMPT,
    PROMPT,
    assert_padded_batches_decode_as_alone,
    decode_against_graph,
    genai_tokens,
    onnxruntime_tokens,
    rel_l2,
    session,
    source,
    transformers_tokens,
)
from prequant_packers import compile_to

from qcompiler.artifact.reader import ArtifactError, open_artifact
from qcompiler.backends.onnx.feeds import greedy
from qcompiler.testing import rehash, run_cli

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 6},
    "gemma2": {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "initializer_range": 0.2},
}
"""family -> config values over test_onnx_package's (Gemma2 already slides a window of 6)."""
WINDOWS = {"llama": [-1, -1], "mistral": [-1, -1], "gemma2": [-1, -1]}
"""Each layer's ``local_window_size``: off, a sliding window is in ``attention_bias`` (``gqa.py``)."""
BIASES = {"llama": 1, "mistral": 1, "gemma2": 2}
"""``attention_bias`` inputs a decoder has: one per window size (Gemma2 alternates sliding and global layers)."""
FORMS = ("gqa", "decomposed")


@pytest.fixture(scope="module")
def built() -> dict[tuple[str, str], tuple[Path, Path]]:
    return {}


@pytest.fixture
def arts(
    request: pytest.FixtureRequest,
    built: dict[tuple[str, str], tuple[Path, Path]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, Path]]:
    """form -> (source, artifact) of the family ``request.param``, each compiled once per module."""
    family = str(request.param)
    for form in FORMS:
        if (family, form) in built:
            continue
        root = tmp_path_factory.mktemp(f"{family}-{form}")
        src = root / "src"
        if not src.exists():
            source(src, family, **FAMILIES[family])
        r = compile_to(src, "onnx-nbits", root / "art", "--scheme", "w4-g32", "--onnx-attention", form)
        assert r.code == 0, r.err
        built[family, form] = (src, root / "art")
    return {form: built[family, form] for form in FORMS}


def attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("arts", list(FAMILIES), indirect=True)
def test_each_attention_layer_is_one_group_query_attention_node(arts: dict[str, tuple[Path, Path]]) -> None:
    """The written decoder: one ``com.microsoft.GroupQueryAttention`` a layer (heads, window, soft cap
    as the model has them, no rotary of its own), no ``Softmax``; onnxruntime's optimised model keeps
    them (verify's dispatch proof); the manifest records the form; genai shares the buffers."""
    art = arts["gqa"][1]
    family = art.parent.name.split("-")[0]
    model = onnx.load(str(art / "model.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert [n.domain for n in nodes] == ["com.microsoft"] * len(WINDOWS[family])
    assert not [n for n in model.graph.node if n.op_type == "Softmax"]
    assert [attrs(n)["local_window_size"] for n in nodes] == WINDOWS[family]
    assert len({n.input[10] for n in nodes}) == BIASES[family]
    for i, n in enumerate(nodes):
        a = attrs(n)
        assert (a["num_heads"], a["kv_num_heads"], a["do_rotary"]) == (4, 2, 0)
        assert a.get("softcap") == (5.0 if family == "gemma2" else None)
        assert list(n.output)[1:] == [f"present.{i}.key", f"present.{i}.value"]
    report = json.loads(run_cli("verify", str(art), "--json").out)
    assert report["ok"], report.get("error")
    dispatch = report["dispatch"]
    print(f"{family}: {len(nodes)} GroupQueryAttention written, {dispatch['group_query_attention']} after optimising")
    assert dispatch["group_query_attention"] == dispatch["attention_layers"] == len(nodes)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["provenance"]["onnx_attention"] == "gqa"
    assert manifest["provenance"]["pipeline"].endswith("emit-container{target=onnx-nbits,attention=gqa}")
    for form, share in (("gqa", True), ("decomposed", False)):
        doc = json.loads((arts[form][1] / "genai_config.json").read_text())
        assert doc["search"]["past_present_share_buffer"] is share


@pytest.mark.parametrize("arts", list(FAMILIES), indirect=True)
def test_greedy_decoding_is_the_graphs_and_the_decomposed_forms(arts: dict[str, tuple[Path, Path]]) -> None:
    """A prefill of 4 tokens at batch 2, then 16 greedy steps one token a run (past the window of 6):
    each token is the one the artifact's full-sequence QIR graph chooses, the logits within 1e-5
    rel-L2 of the graph's, and the tokens are the decomposed artifact's."""
    art = arts["gqa"][1]
    d, errs = decode_against_graph(art)
    decomposed = greedy(session(arts["decomposed"][1] / "model.onnx"), GRAPH_PROMPT, 16)
    assert np.array_equal(d.tokens, decomposed.tokens)
    gap = max(rel_l2(a, b) for a, b in zip(d.logits, decomposed.logits, strict=True))
    print(f"{art.parent.name}: 16 tokens equal; worst {max(errs):.2e} rel-L2 from graph.qir, {gap:.2e} from decomposed")
    assert max(errs) <= 1e-5


@pytest.mark.parametrize("arts", ["llama", "gemma2"], indirect=True)
def test_a_left_padded_batch_decodes_each_prompt_as_alone(arts: dict[str, tuple[Path, Path]]) -> None:
    """Prompts of 3 and 7 tokens, the short one left-padded, then two 5-token prompts: each row's 12
    greedy tokens equal its prompt's alone at batch 1, the last logits within 1e-5 rel-L2, all finite.
    (``seqlens_k`` is the whole mask length and the padding is ``attention_bias``: ``gqa.py``.)"""
    assert_padded_batches_decode_as_alone(arts["gqa"][1])


def genai_batch(art: Path, prompts: list[str], steps: int) -> list[list[int]]:
    """og.Generator's greedy tokens for ``prompts`` as one batch (og.Tokenizer pads them)."""
    og: Any = importlib.import_module("onnxruntime_genai")  # ships no type stubs
    model = og.Model(str(art))
    tok = og.Tokenizer(model)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=48, batch_size=len(prompts))
    gen = og.Generator(model, params)
    gen.append_tokens(tok.encode_batch(prompts) if len(prompts) > 1 else tok.encode(prompts[0]))
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        gen.generate_next_token()
        for row, t in enumerate(gen.get_next_tokens()):
            out[row].append(int(t))
    return out


@pytest.mark.parametrize("arts", list(FAMILIES), indirect=True)
def test_genai_shares_the_buffers_and_generates_the_same_tokens(arts: dict[str, tuple[Path, Path]]) -> None:
    """``og.Model(DIR)`` of the gqa artifact (``past_present_share_buffer: true``): its 12 greedy tokens
    are genai's on the decomposed artifact, onnxruntime's through the cache and transformers' ``generate``
    on the model holding the artifact's decode. A batch of a 4-token and a 2-token prompt (genai pads
    the short one on the right) gives the tokens genai gives the decomposed artifact, and each row's are
    its tokens alone: a sliding window (Mistral, Gemma2: 6, shorter than the row) counts the attended
    positions, not the padding genai leaves inside the row."""
    src, art = arts["gqa"]
    ids, got = genai_tokens(art)
    assert got == genai_tokens(arts["decomposed"][1])[1]
    assert got == onnxruntime_tokens(art, ids, len(got))
    assert got == transformers_tokens(src, art, ids, len(got))
    prompts = [PROMPT, "hello"]
    batch = genai_batch(art, prompts, 10)
    alone = [genai_batch(art, [p], 10)[0] for p in prompts]
    assert batch == genai_batch(arts["decomposed"][1], prompts, 10)
    assert batch == alone
    print(f"{art.parent.name}: genai {got}; padded row {batch[1]}, alone {alone[1]}")


def refused(path: Path) -> ArtifactError:
    with pytest.raises(ArtifactError) as e:
        open_artifact(path)
    r = run_cli("verify", str(path), "--json")
    assert r.code == 1
    assert json.loads(r.out)["error"] == str(e.value)
    return e.value


def edited(art: Path, to: Path, attribute: str, value: int) -> Path:
    """A copy of ``art`` whose first GroupQueryAttention has ``attribute = value`` (set in place, or
    added last), re-hashed."""
    shutil.copytree(art, to)
    model = onnx.load(str(to / "model.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    found = [a for a in node.attribute if a.name == attribute]
    if found:
        found[0].i = value
    else:
        node.attribute.append(onnx.helper.make_attribute(attribute, value))
    (to / "model.onnx").write_bytes(model.SerializeToString())
    rehash(to)
    return to


@pytest.mark.parametrize("arts", ["llama"], indirect=True)
def test_the_reader_refuses_an_edited_attention(arts: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """Each edit re-hashed into the manifest: attributes the nodes gate refuses (``kv_num_heads`` not
    dividing ``num_heads``, ``do_rotary``, an attribute qcompiler does not write), one only the binding
    gate can (``kv_num_heads`` 4 divides 4), the recorded attention form, genai's shared buffer."""
    art = arts["gqa"][1]
    for attribute, value in (("kv_num_heads", 3), ("do_rotary", 1), ("smooth_softmax", 1)):
        e = refused(edited(art, tmp_path / f"{attribute}{value}", attribute, value))
        print(f"{attribute} = {value}: {e}")
        assert (e.file, e.field) == ("model.onnx", attribute), str(e)
    e = refused(edited(art, tmp_path / "kv4", "kv_num_heads", 4))
    print(f"kv_num_heads = 4: {e}")
    assert e.file == "model.onnx", str(e)
    assert e.field.endswith("'scaled_dot_product_attention_gqa'.attribute['kv_num_heads'].i"), str(e)
    assert (e.expected, e.found) == ("2", "4"), str(e)

    recorded = tmp_path / "recorded"
    shutil.copytree(art, recorded)
    manifest = json.loads((recorded / "manifest.json").read_text())
    manifest["provenance"]["onnx_attention"] = "decomposed"
    (recorded / "manifest.json").write_text(json.dumps(manifest))
    rehash(recorded)
    e = refused(recorded)
    print(f"onnx_attention recorded as decomposed: {e}")
    assert e.file == "model.onnx", str(e)
    assert e.message.startswith("differs from what graph.qir lowers to"), str(e)

    unshared = tmp_path / "unshared"
    shutil.copytree(art, unshared)
    doc = json.loads((unshared / "genai_config.json").read_text())
    doc["search"]["past_present_share_buffer"] = False
    (unshared / "genai_config.json").write_text(json.dumps(doc, indent=4))
    rehash(unshared)
    e = refused(unshared)
    print(f"genai_config.json unshared: {e}")
    assert e.file == "genai_config.json", str(e)
    assert "past_present_share_buffer" in str(e), str(e)


def test_gqa_is_refused_where_it_has_no_meaning(tmp_path: Path) -> None:
    """A target that is not onnx, an encoder (no decoder graph) and an unknown form: typed errors, no
    traceback, nothing written."""
    llama = "qcompiler.examples:tiny_llama_hf"
    for src, target, form, word in (
        (llama, "gguf", "gqa", "takes no option attention"),
        ("qcompiler.examples:tiny_bert_hf", "onnx-nbits", "gqa", "is not a causal LM graph"),
        (llama, "onnx-nbits", "fused", "expected one of decomposed, gqa, found 'fused'"),
    ):
        out = tmp_path / f"{target}-{form}"
        r = run_cli(
            "compile", src, "--scheme", "w8-channel", "--target", target, "-o", str(out), "--onnx-attention", form
        )
        assert r.code != 0
        assert word in r.err, r.err
        assert "Traceback" not in r.err, r.err
        assert not out.exists()
