"""SentencePiece vocabularies (``tokenizer.model``, as Llama-2, Mistral, Gemma and Phi-3 ship them)
through the GGUF target, checked against the real peers: a tiny BPE SentencePiece model trained here
with byte fallback (as Llama's), wrapped by transformers' ``LlamaTokenizer`` and saved next to a tiny
random ``LlamaForCausalLM``. llama.cpp (``vocab_only``) tokenizes like transformers and detokenizes
back; the file's tokens/scores/types are what ``sentencepiece`` reports for each piece (added tokens as
the converter rewrites them); ``verify`` passes; broken ``tokenizer.model`` files are refused by name."""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import sentencepiece as spm
import torch
import transformers

from qcompiler.backends.gguf.reader import open_gguf
from qcompiler.backends.gguf.tokenizer import TokenizerError, tokenizer_metadata
from qcompiler.testing import run_cli

TEXT = """The quick brown fox jumps over the lazy dog. Numbers like 12345 and 2024 appear here.
Café crème brûlée, naïve façade. Hello world! hello  world, HELLO.
Tokenizers split text into pieces; pieces become ids. <tool> calls a tool.
"""
STRINGS = [
    "Hello world",
    "  two  leading spaces and   gaps ",
    "digits 0123456789 and 42",
    "café naïve brûlée",
    "a fox 🦊 needs byte fallback",
    "line one\nline two",
]
N_VOCAB = 320
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def listed(value: object) -> list[Any]:
    assert isinstance(value, list)
    return cast("list[Any]", value)


GEMMA_SPECIALS: dict[str, Any] = {
    **{"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3},
    **{"pad_piece": "<pad>", "eos_piece": "<eos>", "bos_piece": "<bos>", "unk_piece": "<unk>"},
    "control_symbols": ["<mask>"],
}
"""Gemma's special pieces and ids (its tokenizer.model has no dummy prefix either)."""


def train(add_dummy_prefix: bool = True, **specials: Any) -> bytes:
    """A BPE SentencePiece model of N_VOCAB pieces with Llama's options (byte fallback, identity)."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(  # pyright: ignore[reportUnknownMemberType]
        sentence_iterator=iter([line for line in TEXT.split("\n") if line] * 20),
        model_writer=out,
        vocab_size=N_VOCAB,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        character_coverage=1.0,
        user_defined_symbols=["<tool>"],
        hard_vocab_limit=False,
        minloglevel=2,
        **specials,
    )
    return out.getvalue()


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("spm") / "llama"
    src.mkdir()
    (src / "tokenizer.model").write_bytes(train())
    tok = transformers.LlamaTokenizer.from_pretrained(src, add_bos_token=True, add_eos_token=False)
    assert len(tok) == N_VOCAB
    tok.save_pretrained(src)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=N_VOCAB, **TINY)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(src)
    return src


@pytest.fixture(scope="module")
def llama_gguf(llama_src: Path) -> Path:
    out = llama_src.parent / "f32"
    r = run_cli("compile", str(llama_src), "--target", "gguf", "-o", str(out), "--quiet")
    assert r.code == 0, r.err
    return out


def test_llama_cpp_tokenizes_like_transformers(llama_src: Path, llama_gguf: Path) -> None:
    from llama_cpp import Llama

    tok = transformers.AutoTokenizer.from_pretrained(llama_src)
    sp = spm.SentencePieceProcessor(model_file=str(llama_src / "tokenizer.model"))
    llm = Llama(model_path=str(llama_gguf / "model.gguf"), vocab_only=True, verbose=False)
    assert llm.n_vocab() == N_VOCAB
    for s in STRINGS:
        got = llm.tokenize(s.encode(), add_bos=True, special=True)
        assert got == [sp.bos_id(), *sp.encode(s)], s
        # llama-cpp-python joins the pieces: the dummy-prefix space stays in front
        assert llm.detokenize(got[1:], special=True).decode() == " " + s, s
        want = tok(s).input_ids
        if s.startswith(" "):  # tokenizers' Metaspace adds no dummy "▁" before a leading space; sentencepiece does
            assert want == [sp.bos_id(), *sp.encode(s[1:])], s
            continue
        assert got == want, s
        assert tok.decode(want, skip_special_tokens=True) == s
    fox = tok("🦊", add_special_tokens=False).input_ids
    assert all(3 < i < 260 for i in fox[1:]), fox  # byte pieces <0xF0> <0x9F> ...
    # an added token: transformers and sentencepiece give it one id; llama.cpp too, but it splits the
    # text there and tokenizes each side as a new text (a dummy-prefix space after the token)
    tool = sp.piece_to_id("<tool>")
    assert tok("call <tool> now").input_ids == [sp.bos_id(), *sp.encode("call <tool> now")]
    assert tool in sp.encode("call <tool> now")
    got = llm.tokenize(b"call <tool> now", add_bos=True, special=True)
    assert got == [sp.bos_id(), *sp.encode("call "), tool, *sp.encode(" now")]


def test_the_file_holds_sentencepiece_pieces(llama_src: Path, llama_gguf: Path) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(llama_src / "tokenizer.model"))
    md = open_gguf(llama_gguf / "model.gguf").metadata
    tokens, scores, types = (listed(md[f"tokenizer.ggml.{k}"][1]) for k in ("tokens", "scores", "token_type"))
    assert md["tokenizer.ggml.model"][1] == "llama"
    assert md["tokenizer.ggml.pre"][1] == "default"
    assert len(tokens) == len(scores) == len(types) == sp.get_piece_size() == N_VOCAB
    added = transformers.AutoTokenizer.from_pretrained(llama_src).added_tokens_decoder
    for i in range(N_VOCAB):
        assert tokens[i] == sp.id_to_piece(i), i
        if i in added:  # the converter's rewrite: score -1000, control if special else user-defined
            assert (scores[i], types[i]) == (-1000.0, 3 if added[i].special else 4), i
            continue
        assert scores[i] == np.float32(sp.get_score(i)), i
        want = 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
        assert types[i] == want, i
    assert sum(t == 6 for t in types) == 256
    assert md["tokenizer.ggml.bos_token_id"][1] == sp.bos_id()
    assert md["tokenizer.ggml.eos_token_id"][1] == sp.eos_id()
    assert md["tokenizer.ggml.unknown_token_id"][1] == sp.unk_id()
    assert md["tokenizer.ggml.add_bos_token"][1] is True
    assert "tokenizer.ggml.add_space_prefix" not in md  # llama.cpp's default (true), as the converter
    assert run_cli("verify", str(llama_gguf)).code == 0


def test_llama_cpp_runs_the_model_with_its_vocab(llama_src: Path, llama_gguf: Path) -> None:
    from llama_cpp import Llama

    ids = transformers.AutoTokenizer.from_pretrained(llama_src)("The quick brown fox").input_ids
    llm = Llama(model_path=str(llama_gguf / "model.gguf"), logits_all=True, n_ctx=64, verbose=False)
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)], dtype=np.float64)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_src).eval()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 2e-3


def files_of(src: Path) -> dict[str, bytes]:
    names = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    return {n: (src / n).read_bytes() for n in names if (src / n).is_file()}


def test_a_larger_vocab_size_is_padded_and_a_smaller_one_refused(llama_src: Path) -> None:
    files = files_of(llama_src)
    md = {kv.key: kv.value for kv in tokenizer_metadata(files, {"vocab_size": N_VOCAB + 4}, "llama")}
    tokens, types = listed(md["tokenizer.ggml.tokens"]), listed(md["tokenizer.ggml.token_type"])
    assert tokens[N_VOCAB:] == [f"[PAD{i}]" for i in range(N_VOCAB, N_VOCAB + 4)]
    assert types[N_VOCAB:] == [5] * 4
    with pytest.raises(TokenizerError, match=rf"tokenizer\.model: .*expected {N_VOCAB - 1}, found {N_VOCAB}"):
        tokenizer_metadata(files, {"vocab_size": N_VOCAB - 1}, "llama")


def corrupt(raw: bytes) -> dict[str, bytes]:
    """Broken ``tokenizer.model`` files: cut short, a bad wire type, a bad piece type, not UTF-8."""
    first = 2 + raw[1]  # the first piece's field: 0x0a, one length byte (a short piece), the message
    piece = raw[2:first]
    return {
        "truncated": raw[: len(raw) // 2],
        "truncated in a piece": raw[: first - 1],
        "wire type 7": b"\x0f",
        "piece type 9": b"\x0a" + bytes([len(piece) + 2]) + piece + b"\x18\x09" + raw[first:],
        "not utf-8": b"\x0a\x04\x0a\x02\xff\xfe" + raw,
        "empty": b"",
    }


@pytest.mark.parametrize(
    "case", ["truncated", "truncated in a piece", "wire type 7", "piece type 9", "not utf-8", "empty"]
)
def test_a_broken_tokenizer_model_is_refused_by_name(llama_src: Path, case: str, tmp_path: Path) -> None:
    raw = (llama_src / "tokenizer.model").read_bytes()
    assert raw[0] == 0x0A
    assert raw[1] < 0x80
    broken = corrupt(raw)[case]
    with pytest.raises(TokenizerError, match=r"^tokenizer\.model: "):
        tokenizer_metadata({"tokenizer.model": broken}, {"vocab_size": N_VOCAB}, "llama")
    if case != "truncated":
        return
    src = tmp_path / "src"
    shutil.copytree(llama_src, src)
    (src / "tokenizer.model").write_bytes(broken)
    out = tmp_path / "out"
    r = run_cli("compile", str(src), "--target", "gguf", "-o", str(out), "--quiet")
    assert r.code != 0
    assert "tokenizer.model" in r.err
    assert "Traceback" not in r.err
    assert not (out / "model.gguf").exists()


def test_a_gemma_vocab_has_no_space_prefix(tmp_path: Path) -> None:
    """Gemma's tokenizer.model adds no dummy prefix; the gemma arch gets ``add_space_prefix`` false."""
    from llama_cpp import Llama

    src = tmp_path / "gemma"
    src.mkdir()
    (src / "tokenizer.model").write_bytes(train(add_dummy_prefix=False, **GEMMA_SPECIALS))
    tok = transformers.GemmaTokenizer.from_pretrained(src)
    tok.save_pretrained(src)
    torch.manual_seed(0)
    config = transformers.GemmaConfig(vocab_size=N_VOCAB, head_dim=16, **TINY)
    transformers.GemmaForCausalLM(config).eval().save_pretrained(src)
    out = tmp_path / "f32"
    r = run_cli("compile", str(src), "--target", "gguf", "-o", str(out), "--quiet")
    assert r.code == 0, r.err
    md = open_gguf(out / "model.gguf").metadata
    assert md["general.architecture"][1] == "gemma"
    assert md["tokenizer.ggml.add_space_prefix"][1] is False
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    llm = Llama(model_path=str(out / "model.gguf"), vocab_only=True, verbose=False)
    for s in STRINGS:
        got = llm.tokenize(s.encode(), add_bos=False, special=True)
        assert got == sp.encode(s), s
        assert got == tok(s, add_special_tokens=False).input_ids, s
        assert llm.detokenize(got, special=True).decode() == s, s
