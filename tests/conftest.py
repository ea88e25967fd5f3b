"""Shared fixtures, and the two test tiers.

Every test file is in exactly one tier, and this table is the one place that says which. The fast
tier (``pytest -m fast``) is the unit tests of the IR, the passes, the codecs, the readers and
containers, and the small core utilities: no peer runtime (llama.cpp, onnxruntime, Triton,
transformers loading a model), no model compile. It runs in under a minute on 2 cores, for a quick
check while editing. Every other file is the peer tier (``pytest -m peer``, the same as ``-m "not
fast"``): it compiles models and runs the real peers against the artifacts. A new file is peer until
it is listed.
"""

from __future__ import annotations

import pytest

from qcompiler.testing import Cli, run_cli

FAST_FILES = frozenset(
    {
        "test_act_order.py",
        "test_decode_digest.py",
        "test_packed_fields.py",
        "test_artifact_writer.py",
        "test_attr_accessors.py",
        "test_blob_store.py",
        "test_frontend_passes.py",
        "test_gguf_codecs.py",
        "test_gguf_reader.py",
        "test_gguf_tokenizer.py",
        "test_gguf_writer.py",
        "test_heap.py",
        "test_interrupt.py",
        "test_layers.py",
        "test_layouts.py",
        "test_mixprec_ir.py",
        "test_mixprec_quant.py",
        "test_mixprec_search.py",
        "test_op_accessors.py",
        "test_parallel.py",
        "test_passes.py",
        "test_plugins.py",
        "test_quant_core.py",
        "test_reading.py",
        "test_rebuilt.py",
        "test_rewrite.py",
        "test_roundtrip.py",
        "test_rung4.py",
        "test_safetensors_container.py",
        "test_size_budget.py",
        "test_tiers.py",
        "test_verifier.py",
    }
)
"""Chosen by what each file runs and by timing it alone (``-n 0``): each takes under 7 s. A quick file
that runs a peer stays peer (``test_gguf_kquant``: ggml's C quantizer from llama-cpp-python, a source
build; ``test_onnx_external``: onnxruntime; ``test_triton_kernels``: Triton's interpreter)."""


def tier(filename: str) -> str:
    """The marker of a test file's tier: ``fast`` if the table lists it, else ``peer``."""
    return "fast" if filename in FAST_FILES else "peer"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier(item.path.name))


@pytest.fixture
def fast_files() -> frozenset[str]:
    """The fast tier's table, for ``test_tiers.py`` (a fixture: importing a conftest depends on the import mode)."""
    return FAST_FILES


@pytest.fixture
def cli() -> Cli:
    """``cli("opt", "file.qir", stdin=...)`` runs the CLI in this process."""
    return run_cli
