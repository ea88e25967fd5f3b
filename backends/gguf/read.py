"""The GGUF backend's reader gates, in order; each failure names file, tensor or key, and field.

1. ``container``: ``model.gguf`` passes the strict GGUF parser (``reader.py``);
2. ``metadata``: a known ``general.architecture``; every key llama.cpp requires is present with
   exactly the type it reads (a u64 where it reads a u32 fails to load); ``block_count`` <= 512;
   ``tokenizer.ggml.model`` present;
3. ``inventory``: exactly the tensors llama.cpp's graph consumes (an extra one fails its load);
   1-D tensors (norms, biases) are F32;
4. ``graph``: ``graph.qir`` parses and verifies with its tensors read from the GGUF's blocks (sha256
   checked, codes inside their alphabet, each part of the declared shape and dtype), and each
   descriptor's code layout matches the ggml type; then the graph binds the rest of the file:
   every GGUF tensor is read by a ``gguf:`` location, every tensor of ``graph.safetensors`` by a
   ``safetensors:`` one (its ``__metadata__`` the writer's), the architecture computes what the graph
   computes (``ARCH_FACTS``), each key of ``METADATA_FACTS`` means what the graph computes (ints
   exact, epsilons float32-exact, ``rope.freq_base`` reproducing the graph's ``inv_freq``, token
   arrays one entry per vocabulary row), and every key (tokenizer, ``general.*``, context length ...)
   has the sha256 ``graph.qir``'s ``bound.gguf`` record holds: an added, removed or edited key is
   refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from qcompiler.artifact.reader import ArtifactError, as_artifact, read_graph
from qcompiler.artifact.request import ContainerEntry, OpenedArtifact
from qcompiler.backends.gguf.archs import ARCHS
from qcompiler.backends.gguf.archs_moe import stacked
from qcompiler.backends.gguf.blobs import referenced
from qcompiler.backends.gguf.ggml_types import GGMLType
from qcompiler.backends.gguf.plan import ENCODING_TYPE, GGUF_FILE, GRAPH_FILE, gguf_weights
from qcompiler.backends.gguf.reader import GGUFFile, open_gguf
from qcompiler.backends.gguf.rope_freqs import TENSOR as ROPE_FREQS
from qcompiler.backends.gguf.rope_freqs import factor_digests, factors_of
from qcompiler.backends.gguf.tensor_tables import REQUIRED_KEYS, expected_tensors
from qcompiler.backends.gguf.writer import GGUFValueType as V
from qcompiler.backends.safetensors import blobs as st_blobs
from qcompiler.errors import FileError, QcError
from qcompiler.ir.core import Module
from qcompiler.ir.facts import ModelFacts, check_recorded, digest, model_facts, rope_matches
from qcompiler.paths import PathError, open_in

MAX_BLOCKS = 512


MetaRule = tuple[str, str, str]
"""(GGUF key, ``{arch}`` standing for the architecture; the graph fact it restates; comparison)."""
METADATA_FACTS: tuple[MetaRule, ...] = (
    ("{arch}.embedding_length", "hidden", "int"),
    ("{arch}.block_count", "layers", "int"),
    ("{arch}.feed_forward_length", "ff", "int"),
    ("{arch}.attention.head_count", "heads", "int"),
    ("{arch}.attention.head_count_kv", "kv_heads", "int"),
    ("{arch}.attention.key_length", "head_dim", "int"),
    ("{arch}.attention.value_length", "head_dim", "int"),
    ("{arch}.attention.layer_norm_rms_epsilon", "eps", "f32"),
    ("{arch}.attention.layer_norm_epsilon", "eps", "f32"),
    ("{arch}.rope.dimension_count", "rotary_dim", "int"),
    ("{arch}.rope.freq_base", "inv_freq", "rope"),
    ("{arch}.vocab_size", "vocab", "int"),
    ("{arch}.context_length", "positions", "int"),
    ("{arch}.attention.causal", "causal", "bool"),
    ("tokenizer.ggml.token_type_count", "token_types", "int"),
    ("tokenizer.ggml.tokens", "vocab", "count"),
    ("tokenizer.ggml.token_type", "vocab", "count"),
    ("tokenizer.ggml.scores", "vocab", "count"),
)
"""Each key llama.cpp's loader interprets for llama and bert that the graph also shows (a fact the
graph does not show, like a llama's context length, is skipped here and bound by the record)."""
DECODER_FACTS: dict[str, tuple[object, ...]] = {"causal": (True,), "norm": ("rms",), "act": ("silu",)}
ARCH_FACTS: dict[str, dict[str, tuple[object, ...]]] = {
    "llama": DECODER_FACTS,
    "qwen2": DECODER_FACTS,
    "qwen3": DECODER_FACTS,
    "gemma": {**DECODER_FACTS, "act": ("gelu_tanh",)},
    "gemma2": {**DECODER_FACTS, "act": ("gelu_tanh",)},
    "gemma3": {**DECODER_FACTS, "act": ("gelu_tanh",)},
    "phi3": DECODER_FACTS,
    "qwen2moe": DECODER_FACTS,
    "qwen3moe": DECODER_FACTS,
    "bert": {"causal": (False,), "norm": ("layer",), "act": ("gelu", "gelu_tanh")},
    "gpt2": {"causal": (True,), "norm": ("layer",), "act": ("gelu_tanh", None)},
}
"""What llama.cpp's graph for each architecture computes; the module's graph must compute the same.
GPT-2's ``gelu_new`` is exported as its tanh formula, no activation op: the graph then shows none."""
NOT_RESTATED = {"gemma3": ("gemma3.rope.freq_base",)}
"""Keys that do not restate the graph fact of their name: gemma3's ``rope.freq_base`` is the full
layers' base, and the sliding layers' is fixed in llama.cpp's graph (both are bound by the record)."""
RECORD = "gguf"
"""The section of ``graph.qir``'s ``bound`` record that holds a sha256 per GGUF key."""


def metadata_digests(f: GGUFFile) -> dict[str, str]:
    """GGUF key -> sha256 of (value type, array element type, value) as the strict reader returns them;
    and ``tensor rope_freqs.weight`` -> sha256 of its values (derived from the graph, ``rope_freqs.py``)."""
    keys = {key: digest([vtype, f.array_types.get(key), value]) for key, (vtype, value) in f.metadata.items()}
    return keys | factor_digests(f)


def agrees(kind: str, facts: ModelFacts, fact: object, value: object, factors: np.ndarray | None = None) -> bool:
    """Whether a GGUF ``value`` means the graph's ``fact`` under comparison ``kind``."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "int":
        return type(value) is int and value == fact
    if kind == "f32":
        return number and isinstance(fact, float) and np.float32(value) == np.float32(fact)  # pyright: ignore
    if kind == "bool":
        return value is fact
    if kind == "count":
        return isinstance(value, list) and len(value) == fact  # pyright: ignore[reportUnknownArgumentType]
    return number and rope_matches(facts, float(value), factors)  # pyright: ignore[reportArgumentType]


def check_meaning(f: GGUFFile, arch: str, m: Module) -> None:
    """The architecture and each ``METADATA_FACTS`` key against the facts of ``m``'s graph."""
    facts = model_facts(m)
    for fact_name, allowed in ARCH_FACTS[arch].items():
        fact = getattr(facts, fact_name)
        if fact not in allowed:
            raise ArtifactError(
                f"llama.cpp's {arch} graph computes another {fact_name} than graph.qir",
                file=GGUF_FILE,
                field="general.architecture",
                expected=f"{fact_name} {' | '.join(map(str, allowed))}",
                found=fact,
            )
    for template, fact_name, kind in METADATA_FACTS:
        key = template.format(arch=arch)
        fact = getattr(facts, fact_name)
        if key not in f.metadata or fact is None or key in NOT_RESTATED.get(arch, ()):
            continue
        value = f.metadata[key][1]
        if not agrees(kind, facts, fact, value, factors_of(f)):
            shown = f"inv_freq of base {facts.rope_base:.6g}" if kind == "rope" and facts.rope_base else fact
            if kind == "rope" and factors_of(f) is not None:
                shown = f"inv_freq[i] = {value} ** (-2i / {facts.rotary_dim}) / {ROPE_FREQS}[i]"
            raise ArtifactError(
                f"disagrees with what graph.qir computes ({fact_name})",
                file=GGUF_FILE,
                field=key,
                expected=shown,
                found=f"{len(value)} entries" if isinstance(value, list) else value,  # pyright: ignore
            )


def check_binding(root: Path, f: GGUFFile, arch: str, m: Module) -> None:
    """Gate ``graph``, second half: every tensor and key of the container is bound by ``m``."""
    used = referenced(m).get(GGUF_FILE, set())
    for name in f.tensors:
        if name not in used and name != ROPE_FREQS:  # rope_freqs: bound by the record and the rope check
            raise ArtifactError(
                f"tensor {name} is in {GGUF_FILE} but nothing binds it (no location of graph.qir reads it)",
                file=GGUF_FILE,
                tensor=name,
                expected="a tensor graph.qir references",
                found="unreferenced",
            )
    if (root / GRAPH_FILE).exists():
        st_blobs.check_bound(GRAPH_FILE, st_blobs.opened_checked(root, GRAPH_FILE), m)
    check_meaning(f, arch, m)
    try:
        check_recorded(m, RECORD, metadata_digests(f), file=GGUF_FILE)
    except FileError as e:
        raise as_artifact(e) from None


def check_metadata(f: GGUFFile) -> str:
    arch_v = f.metadata.get("general.architecture")
    arch = arch_v[1] if arch_v and arch_v[0] == V.STRING else None
    if not isinstance(arch, str) or arch not in ARCHS:
        raise ArtifactError(
            "unknown architecture", file=GGUF_FILE, field="general.architecture", expected=" | ".join(ARCHS), found=arch
        )
    for key, want in {**REQUIRED_KEYS[arch], "tokenizer.ggml.model": V.STRING}.items():
        got = f.metadata.get(key)
        if got is None:
            raise ArtifactError(
                "required by llama.cpp but missing", file=GGUF_FILE, field=key, expected=want.name, found="none"
            )
        if got[0] != want:
            raise ArtifactError(
                "wrong type (llama.cpp checks it exactly)",
                file=GGUF_FILE,
                field=key,
                expected=want.name,
                found=V(got[0]).name,
            )
    blocks = f.metadata[f"{arch}.block_count"][1]
    if not isinstance(blocks, int) or not 1 <= blocks <= MAX_BLOCKS:
        raise ArtifactError(
            "out of range", file=GGUF_FILE, field=f"{arch}.block_count", expected=f"1..{MAX_BLOCKS}", found=blocks
        )
    return arch


def check_inventory(f: GGUFFile, arch: str) -> None:
    blocks = f.metadata[f"{arch}.block_count"][1]
    assert isinstance(blocks, int)
    experts = f.metadata.get(f"{arch}.expert_count", (V.UINT32, 0))[1]
    want = expected_tensors(arch, blocks, isinstance(experts, int) and experts > 0)
    for name in f.tensors:
        if name not in want:
            raise ArtifactError(
                f"not a tensor of llama.cpp's {arch} graph (its load would fail)",
                file=GGUF_FILE,
                field="tensors",
                expected="no such tensor",
                found=name,
            )
    for name, required in want.items():
        if required and name not in f.tensors:
            raise ArtifactError(
                f"llama.cpp's {arch} graph needs it", file=GGUF_FILE, field="tensors", expected=name, found="none"
            )
    for name, info in f.tensors.items():
        if len(info.shape) == 1 and info.type_id != GGMLType.F32:
            raise ArtifactError(
                "1-D tensors (norms, biases) must be F32: llama.cpp adds them to F32 activations",
                file=GGUF_FILE,
                field=name,
                expected="F32",
                found=GGMLType(info.type_id).name,
            )


def check_graph(root: Path, f: GGUFFile) -> Module:
    m = read_graph(root)
    for w in gguf_weights(m).values():
        want = ENCODING_TYPE.get(w.t.pack.encoding) if w.t.pack.family in ("ggml", "ggml-k") else None
        loc = m.tensors[w.refs["codes"]].blob.location
        name = stacked(loc.partition("#")[2].partition("@")[0])[0]
        info = f.tensors.get(name)
        if want is None or info is None or info.type_id != want:
            raise ArtifactError(
                "descriptor disagrees with the GGUF tensor type",
                file="graph.qir",
                field=w.hf,
                expected=want.name if want else "a ggml code layout",
                found=GGMLType(info.type_id).name if info else "no tensor",
            )
    return m


def open_gguf_dir(root: Path, manifest: dict[str, Any] | None) -> OpenedArtifact:
    try:
        fh, _ = open_in(root, GGUF_FILE)
    except PathError as e:
        raise as_artifact(e) from None
    try:
        f = open_gguf(root / GGUF_FILE, fh=fh)
    except QcError as e:
        raise ArtifactError(str(e), file=GGUF_FILE) from None
    arch = check_metadata(f)
    check_inventory(f, arch)
    module = check_graph(root, f)
    check_binding(root, f, arch, module)
    entries = [ContainerEntry(n, GGUF_FILE, GGMLType(i.type_id).name, i.shape, i.nbytes) for n, i in f.tensors.items()]
    gates = ["container", "metadata", "inventory", "graph"]
    files = {GGUF_FILE, "graph.qir", *([GRAPH_FILE] if (root / GRAPH_FILE).exists() else [])}
    return OpenedArtifact(root, "gguf", manifest, module, entries, gates, files=files)
