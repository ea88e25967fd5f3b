"""The files a runtime reads besides the graphs: the source's tokenizer and generation files (carried
byte for byte), ``config.json`` and, for a causal LM of a type onnxruntime-genai knows,
``genai_config.json``.

| file | how it is made |
|---|---|
| tokenizer files, ``generation_config.json`` (``TOKENIZER_FILES``) | carried from the source as they are |
| ``config.json`` | the source's config without ``quantization_config`` (no compressed-tensors checkpoint) |
| ``generation_config.json``, when the source has none (causal LMs) | derived: config.json's bos/eos/pad ids |
| ``genai_config.json`` (causal LMs, ``genai.GENAI_TYPES``) | derived: ``genai.genai_config`` |

``graph.qir``'s ``bound`` record holds each file's sha256 under ``files`` (carried) or ``derived``,
and the manifest says which are which (``provenance.package``), both checked by the reader
(``package_check.py``), which also rebuilds every derived file and requires the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import onnx

from qcompiler.artifact.manifest import TOKENIZER_FILES
from qcompiler.artifact.reader import parse_json
from qcompiler.artifact.request import SourceInfo
from qcompiler.backends.onnx import genai
from qcompiler.backends.onnx.package_facts import graph_facts
from qcompiler.ir.core import Module
from qcompiler.ir.facts import recorded

CONFIG = "config.json"
GENERATION = "generation_config.json"
CARRIED, DERIVED = "files", "derived"
"""Sections of ``graph.qir``'s ``bound`` record: files carried from the source, files derived here."""
RUNTIME_FILES = frozenset({*TOKENIZER_FILES, CONFIG, genai.FILE})
"""Every file name an ONNX artifact may hold besides its graphs."""


def dumps(doc: object) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def config_doc(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != "quantization_config"}


def generation_doc(config: dict[str, Any]) -> dict[str, Any]:
    """A generation_config.json for a causal LM whose source has none: its special token ids."""
    return {k: config[k] for k in genai.TOKEN_IDS if config.get(k) is not None}


def genai_doc(
    config: dict[str, Any], generation: bytes | None, m: Module, decoder: onnx.ModelProto | None, level: int
) -> dict[str, Any] | None:
    """genai_config.json's document for ``m`` with its written ``decoder`` graph, or None."""
    facts = graph_facts(m)
    if facts is None or decoder is None:
        return None
    gen = parse_json(generation, GENERATION) if generation is not None else {}
    return genai.genai_config(config, gen if isinstance(gen, dict) else {}, facts, decoder, level)


@dataclass
class Package:
    carried: dict[str, bytes] = field(default_factory=dict[str, bytes])
    derived: dict[str, bytes] = field(default_factory=dict[str, bytes])

    def files(self) -> dict[str, bytes]:
        return dict(sorted({**self.carried, **self.derived}.items()))

    def record(self) -> dict[str, dict[str, str]]:
        """The ``bound`` record's sections: name -> sha256."""
        digest = {n: hashlib.sha256(d).hexdigest() for n, d in self.files().items()}
        return {CARRIED: {n: digest[n] for n in self.carried}, DERIVED: {n: digest[n] for n in self.derived}}


def build(src: SourceInfo | None, m: Module, decoder: onnx.ModelProto | None, level: int) -> Package:
    """The runtime files of an artifact of ``m`` (module docstring); ``level``: its accuracy level."""
    if src is None:
        return Package()
    pkg = Package(carried=dict(src.files))
    if src.config is None:
        return pkg
    config = config_doc(src.config)
    pkg.derived[CONFIG] = dumps(config)
    facts = graph_facts(m)
    if GENERATION not in pkg.carried and facts is not None and facts.causal:
        pkg.derived[GENERATION] = dumps(generation_doc(config))
    generation = pkg.carried.get(GENERATION, pkg.derived.get(GENERATION))
    doc = genai_doc(config, generation, m, decoder, level)
    if doc is not None:
        pkg.derived[genai.FILE] = dumps(doc)
    return pkg


def provenance(m: Module, config: dict[str, Any] | None) -> dict[str, Any]:
    """``provenance.package`` of the manifest: which files are carried, which derived, and the genai
    model type (or why there is no genai_config.json), from graph.qir's record and config.json."""
    facts = graph_facts(m)
    kind, why = genai.genai_type(config or {}, facts is not None and facts.causal)
    if config is None:
        kind, why = None, "no source config"
    return {
        "carried": sorted(recorded(m, CARRIED) or {}),
        "derived": sorted(recorded(m, DERIVED) or {}),
        "genai": {"model_type": kind} if kind else {"model_type": None, "reason": why},
    }
