"""The GGUF writer against gguf-py (byte-identical files, read back by GGUFReader and by our strict
reader), and the architecture tables against gguf-py's own name maps and llama.cpp's Q/K rule."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from qcompiler.backends.gguf.archs import ARCHS, qk_row_permutation
from qcompiler.backends.gguf.reader import open_gguf
from qcompiler.backends.gguf.writer import KV, GGUFValueType, GGUFWriteError, TensorPayload, serialize


def sample() -> tuple[list[KV], list[TensorPayload], dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    h = rng.standard_normal((5, 8)).astype(np.float16)
    q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    kvs = [
        KV.string("general.architecture", "llama"),
        KV.u32("llama.context_length", 64),
        KV.f32("llama.attention.layer_norm_rms_epsilon", 1e-5),
        KV.array("tokenizer.ggml.tokens", GGUFValueType.STRING, ["a", "b", "\u2581c"]),
        KV.array("tokenizer.ggml.scores", GGUFValueType.FLOAT32, [0.0, 1.0, 2.0]),
        KV.array("tokenizer.ggml.token_type", GGUFValueType.INT32, [1, 3, 1]),
        KV.boolean("bert.attention.causal", False),
    ]
    tensors = [
        TensorPayload("a", (3, 4), 0, a.tobytes()),
        TensorPayload("h", (5, 8), 1, h.tobytes()),
        TensorPayload("q", (2, 64), 8, q.tobytes()),
    ]
    return kvs, tensors, {"a": a, "h": h, "q": q}


def test_bytes_equal_gguf_py_writer(tmp_path: Path) -> None:
    kvs, tensors, arrays = sample()
    ours = tmp_path / "ours.gguf"
    ours.write_bytes(b"".join(serialize(kvs, tensors)))
    theirs = tmp_path / "theirs.gguf"
    w = gguf.GGUFWriter(str(theirs), "llama")
    w.add_uint32("llama.context_length", 64)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_token_list(["a", "b", "\u2581c"])
    w.add_token_scores([0.0, 1.0, 2.0])
    w.add_token_types([1, 3, 1])
    w.add_bool("bert.attention.causal", False)
    w.add_tensor("a", arrays["a"])
    w.add_tensor("h", arrays["h"])
    w.add_tensor("q", arrays["q"], raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert ours.read_bytes() == theirs.read_bytes()
    f = open_gguf(ours)
    assert list(f.tensors) == ["a", "h", "q"]
    assert np.array_equal(f.array("a"), arrays["a"])
    assert np.array_equal(f.array("q"), arrays["q"])
    assert f.metadata["llama.context_length"] == (GGUFValueType.UINT32, 64)


def test_tensors_made_when_written_give_the_same_bytes() -> None:
    """A payload may be a function called when its tensor is written (one tensor's bytes held at a
    time); the file is the same, and a function that returns other than the declared size is refused."""
    kvs, tensors, _ = sample()
    made: list[str] = []

    def later(t: TensorPayload) -> TensorPayload:
        data = t.data
        assert not callable(data)

        def make() -> bytes | memoryview:
            made.append(t.name)
            return data

        return TensorPayload(t.name, t.shape, t.type_id, make, memoryview(data).nbytes)

    chunks = serialize(kvs, [later(t) for t in tensors])
    head = next(chunks)
    assert not made  # the header needs only the sizes
    assert bytes(head) + b"".join(chunks) == b"".join(serialize(kvs, tensors))
    assert made == [t.name for t in tensors]
    short = TensorPayload("x", (4,), 0, lambda: b"\0" * 12, 16)
    with pytest.raises(GGUFWriteError, match="12 bytes made, 16 declared"):
        b"".join(serialize([], [short]))


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        (KV.u32("k", -1), "does not fit UINT32"),
        (KV.u32("k", 2**32), "does not fit UINT32"),
        (KV.boolean("k", 1), "expected a bool"),  # type: ignore[arg-type]
        (KV.string("", "x"), "key must not be empty"),
        (KV("k", GGUFValueType.ARRAY, [[1]], GGUFValueType.ARRAY), "non-array element type"),
    ],
)
def test_bad_values_are_refused(kv: KV, message: str) -> None:
    with pytest.raises(GGUFWriteError, match=message):
        b"".join(serialize([kv], []))


def test_bad_tensors_are_refused() -> None:
    with pytest.raises(GGUFWriteError, match=r"must be 1\.\.63 bytes"):
        b"".join(serialize([], [TensorPayload("x" * 64, (4,), 0, b"\0" * 16)]))
    with pytest.raises(GGUFWriteError, match=r"1-4 positive dims"):
        b"".join(serialize([], [TensorPayload("x", (1, 1, 1, 1, 4), 0, b"\0" * 16)]))
    with pytest.raises(GGUFWriteError, match="duplicate tensor name 'x'"):
        b"".join(serialize([], [TensorPayload("x", (4,), 0, b"\0" * 16)] * 2))


HF_NAMES = {
    "llama": [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ],
    "bert": [
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
        "encoder.layer.0.attention.self.query.weight",
        "encoder.layer.1.attention.self.key.bias",
        "encoder.layer.0.attention.self.value.weight",
        "encoder.layer.0.attention.output.dense.weight",
        "encoder.layer.0.attention.output.LayerNorm.bias",
        "encoder.layer.0.intermediate.dense.weight",
        "encoder.layer.1.output.dense.bias",
        "encoder.layer.0.output.LayerNorm.weight",
    ],
}
GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "bert": gguf.MODEL_ARCH.BERT}


@pytest.mark.parametrize("arch", sorted(HF_NAMES))
def test_names_agree_with_gguf_py(arch: str) -> None:
    theirs = gguf.get_tensor_name_map(GGUF_ARCH[arch], 2)
    for hf in HF_NAMES[arch]:
        assert ARCHS[arch].gguf_name(hf) == theirs.get_name(hf, try_suffixes=(".weight", ".bias")), hf
    assert ARCHS["bert"].is_dropped("pooler.dense.weight")
    assert ARCHS["llama"].gguf_name("model.rotary_emb.inv_freq") is None


@pytest.mark.parametrize(("rows", "heads"), [(64, 4), (32, 2), (256, 8)])
def test_qk_permutation_is_llama_cpp_reshape(rows: int, heads: int) -> None:
    w = np.arange(rows * 3).reshape(rows, 3)
    want = w.reshape(heads, 2, rows // heads // 2, 3).swapaxes(1, 2).reshape(rows, 3)
    perm = qk_row_permutation(rows, heads)
    assert np.array_equal(w[perm], want)
    assert sorted(perm.tolist()) == list(range(rows))  # a permutation: codes move, never change
