"""Gate ``package``: the runtime files (``package.py``) say what the graphs compute, and are the ones written.

In order, each failure naming the file, field (or tensor), expected and found:

1. every runtime file present is one ``graph.qir``'s ``bound`` record lists (``files``: carried,
   ``derived``), and every listed one is present; no other name is a runtime file;
2. ``config.json``: a JSON object without ``quantization_config`` whose layers, heads, key/value
   heads, head size, hidden size and vocabulary (``package_facts.CONFIG_KEYS``) are graph.qir's;
3. the decoder graph (``genai.DECODER_FILE``) of a causal LM: its ``past_key_values.N.key/value``
   inputs are 2 x layers, each ``[?, kv_heads, ?, head_size]``, and its logits end in the vocabulary;
4. every derived file is what the writer derives from graph.qir, config.json and the decoder graph:
   ``generation_config.json`` (when derived) byte for byte; ``genai_config.json`` field by field,
   the first differing field named (``model.decoder.num_key_value_heads``); a causal LM of a type
   genai knows must have one;
5. every file has the sha256 the record holds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import onnx

from qcompiler.artifact.reader import GRAPH, ArtifactError, as_artifact, read_json, tree
from qcompiler.backends.onnx import genai
from qcompiler.backends.onnx.package import (
    CARRIED,
    CONFIG,
    DERIVED,
    GENERATION,
    RUNTIME_FILES,
    config_doc,
    dumps,
    genai_doc,
    generation_doc,
)
from qcompiler.backends.onnx.package_facts import GraphFacts, disagreements, graph_facts
from qcompiler.ir.core import Module
from qcompiler.ir.facts import recorded
from qcompiler.paths import PathError, read_bounded

MAX_RUNTIME_FILE = 256 * 2**20
"""Largest runtime file read (a large tokenizer.json is ~20 MB)."""
PAST = "past_key_values."


def read(root: Path, rel: str) -> bytes:
    try:
        return read_bounded(root, rel, MAX_RUNTIME_FILE)
    except PathError as e:
        raise as_artifact(e) from None


def bound_files(root: Path, m: Module) -> tuple[dict[str, str], dict[str, str]]:
    """Step 1: the record's carried and derived sections, matched against the runtime files present."""
    carried, derived = recorded(m, CARRIED), recorded(m, DERIVED)
    present = sorted(rel for rel in tree(root) if rel in RUNTIME_FILES)
    if carried is None or derived is None:
        if present:
            raise ArtifactError(
                "graph.qir records no binding for the runtime files", file=GRAPH, field=f"bound.{CARRIED}/{DERIVED}"
            )
        return {}, {}
    listed = {**carried, **derived}
    for rel in present:
        if rel not in listed:
            raise ArtifactError("nothing binds this runtime file", file=rel, expected="listed by graph.qir", found=rel)
    for rel in sorted(listed):
        if rel not in RUNTIME_FILES:
            raise ArtifactError("not a runtime file", file=GRAPH, field="bound", expected="runtime files", found=rel)
        if rel not in present:
            raise ArtifactError("bound by graph.qir but missing", file=rel, expected="present", found="none")
    return carried, derived


def check_config(config: Any, facts: GraphFacts | None) -> dict[str, Any]:
    """Step 2."""
    if not isinstance(config, dict):
        raise ArtifactError("must be a JSON object", file=CONFIG, expected="object", found=type(config).__name__)
    doc: dict[str, Any] = config  # pyright: ignore[reportUnknownVariableType]
    if "quantization_config" in doc:
        raise ArtifactError(
            "the ONNX graph is not a quantized transformers checkpoint",
            file=CONFIG,
            field="quantization_config",
            expected="absent",
            found="present",
        )
    for key, want, found in disagreements(doc, facts) if facts is not None else []:
        raise ArtifactError("disagrees with graph.qir", file=CONFIG, field=key, expected=want, found=found)
    return doc


def check_decoder(decoder: onnx.ModelProto, facts: GraphFacts) -> None:
    """Step 3."""

    def fail(message: str, tensor: str, field: str, want: object, found: object) -> ArtifactError:
        return ArtifactError(message, file=genai.DECODER_FILE, tensor=tensor, field=field, expected=want, found=found)

    past = [i for i in decoder.graph.input if i.name.startswith(PAST)]
    names = [f"{PAST}{n}.{kv}" for n in range(facts.layers) for kv in ("key", "value")]
    if sorted(i.name for i in past) != sorted(names):
        raise fail("one key and one value input per layer of graph.qir", PAST, "inputs", names, [i.name for i in past])
    want_dims = (None, facts.kv_heads, None, facts.head_dim)
    for i in past:
        dims = [d.dim_value if d.HasField("dim_value") else None for d in i.type.tensor_type.shape.dim]
        if len(dims) != 4 or any(w is not None and d != w for d, w in zip(dims, want_dims, strict=True)):
            raise fail("a past input is [batch, kv_heads, past, head_size]", i.name, "dims", want_dims, dims)
    logits = next((o for o in decoder.graph.output if o.name == "logits"), None)
    last = logits.type.tensor_type.shape.dim[-1] if logits and logits.type.tensor_type.shape.dim else None
    if facts.vocab is not None and (last is None or last.dim_value != facts.vocab):
        raise fail("the logits end in the vocabulary", "logits", "dims[-1]", facts.vocab, last and last.dim_value)


def first_difference(want: object, found: object, at: str) -> tuple[str, object, object] | None:
    """The first dotted field where two JSON documents differ (``json`` equality: 1 is not ``true``)."""
    if isinstance(want, dict) and isinstance(found, dict):
        w: dict[str, Any] = want  # pyright: ignore[reportUnknownVariableType]
        f: dict[str, Any] = found  # pyright: ignore[reportUnknownVariableType]
        for key in sorted(set(w) | set(f)):
            diff = first_difference(w.get(key, "(absent)"), f.get(key, "(absent)"), f"{at}.{key}" if at else key)
            if diff is not None:
                return diff
        return None
    if json.dumps(want, sort_keys=True) != json.dumps(found, sort_keys=True):
        return at, want, found
    return None


def check_derived_files(
    root: Path, m: Module, config: dict[str, Any] | None, decoder: onnx.ModelProto | None, level: int, derived: set[str]
) -> None:
    """Step 4."""
    if config is None:
        for rel in sorted(derived):
            raise ArtifactError("derived from config.json, which the artifact lacks", file=rel, expected=CONFIG)
        return
    if GENERATION in derived and read(root, GENERATION) != dumps(generation_doc(config)):
        raise ArtifactError("differs from config.json's token ids", file=GENERATION, expected=generation_doc(config))
    generation = read(root, GENERATION) if (root / GENERATION).is_file() else None
    want = genai_doc(config, generation, m, decoder, level)
    if want is None and genai.FILE in derived:
        raise ArtifactError("onnxruntime-genai runs no model of this type", file=genai.FILE, found="present")
    if want is None:
        return
    if genai.FILE not in derived:
        raise ArtifactError("a causal LM of a type onnxruntime-genai runs", file=genai.FILE, expected="present")
    diff = first_difference(want, read_json(root, genai.FILE, MAX_RUNTIME_FILE), "")
    if diff is not None:
        raise ArtifactError(
            "disagrees with graph.qir, config.json and the decoder graph",
            file=genai.FILE,
            field=diff[0],
            expected=diff[1],
            found=diff[2],
        )


def check_package(root: Path, m: Module, decoder: onnx.ModelProto | None, level: int) -> tuple[set[str], Any]:
    """Gate ``package`` (module docstring); returns the runtime files and config.json (None if absent)."""
    carried, derived = bound_files(root, m)
    facts = graph_facts(m)
    if CONFIG in carried:
        raise ArtifactError("config.json is derived, not carried", file=GRAPH, field=f"bound.{CARRIED}", found=CONFIG)
    config = check_config(read_json(root, CONFIG, MAX_RUNTIME_FILE), facts) if CONFIG in derived else None
    if facts is not None and facts.causal and decoder is not None:
        check_decoder(decoder, facts)
    check_derived_files(root, m, config and config_doc(config), decoder, level, set(derived))
    for rel, want in sorted({**carried, **derived}.items()):
        found = hashlib.sha256(read(root, rel)).hexdigest()
        if found != want:
            raise ArtifactError(
                "differs from what the writer wrote (graph.qir binds its sha256)",
                file=rel,
                field="sha256",
                expected=want,
                found=found,
            )
    return set(carried) | set(derived), config
