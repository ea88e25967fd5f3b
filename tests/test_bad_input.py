"""Bad input never ends in a raw traceback: every case below is a typed error (exit 1) whose message
names the file and field, and nothing is published. The list is the one measured against the CLI
(corrupt, non-UTF-8 and mistyped config.json, unknown model_type, config without weights, truncated
checkpoint, a factory that raises, out-of-vocabulary and negative tokens, non-UTF-8 and deeply nested
IR, negative --max-new-tokens, a nested manifest) plus the silent-data-loss case: an older GPTQ
repository, which transformers would load as a random model and qcompiler reads as stored. The last
tests cover the CLI's own backstop: an exception that is not a ``QcError`` is reported as an internal
error in one paragraph with the command to rerun under ``QC_DEBUG=1``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qcompiler.artifact.reader import open_artifact
from qcompiler.examples import tiny_llama_hf
from qcompiler.parity import decoded, weights
from qcompiler.testing import CliResult, run_cli

LLAMA = "qcompiler.examples:tiny_llama_hf"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("src") / "llama"
    tiny_llama_hf().save_pretrained(path)  # pyright: ignore[reportCallIssue]
    return path


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("art") / "tiny"
    r = run_cli("compile", LLAMA, "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out))
    assert r.code == 0, r.err
    return out


def source(llama_dir: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "src"
    shutil.copytree(llama_dir, dest)
    return dest


def refused(r: CliResult, *parts: str) -> None:
    """Exit 1, one typed message naming ``parts``, no traceback."""
    assert r.code == 1, (r.code, r.err)
    assert "Traceback" not in r.err, r.err
    assert "internal error" not in r.err, r.err
    first = r.err.strip().splitlines()[0]
    assert first.startswith("error: ") or ": error: " in first, r.err
    for part in parts:
        assert part in r.err, (part, r.err)


def compile_dir(path: Path, tmp_path: Path, *extra: str) -> CliResult:
    out = tmp_path / "out"
    r = run_cli("compile", str(path), "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out), *extra)
    assert not out.exists() or r.code == 0, "nothing is published on failure"
    return r


def edit_config(path: Path, edit: Callable[[dict[str, object]], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def test_corrupt_config_json(llama_dir: Path, tmp_path: Path) -> None:
    src = source(llama_dir, tmp_path)
    (src / "config.json").write_text('{"model_type": "llama", ')
    refused(compile_dir(src, tmp_path), "config.json", "invalid JSON")


def test_non_utf8_config_json(llama_dir: Path, tmp_path: Path) -> None:
    src = source(llama_dir, tmp_path)
    (src / "config.json").write_bytes(b'{"model_type": "ll\xffama"}')
    refused(compile_dir(src, tmp_path), "config.json", "not UTF-8")


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("hidden_size", "64", "hidden_size"),
        ("num_hidden_layers", -2, "num_hidden_layers"),
        ("vocab_size", 1 << 40, "vocab_size"),
        ("rms_norm_eps", "tiny", "rms_norm_eps"),
        ("architectures", "LlamaForCausalLM", "architectures"),
    ],
)
def test_mistyped_config_json(llama_dir: Path, tmp_path: Path, key: str, value: object, field: str) -> None:
    src = source(llama_dir, tmp_path)
    edit_config(src, lambda c: c.__setitem__(key, value))
    refused(compile_dir(src, tmp_path), "config.json", field)


def test_unknown_model_type(llama_dir: Path, tmp_path: Path) -> None:
    src = source(llama_dir, tmp_path)
    edit_config(src, lambda c: c.__setitem__("model_type", "llamalike"))
    refused(compile_dir(src, tmp_path), "config.json", "model_type", "llamalike")


def test_config_without_weights(llama_dir: Path, tmp_path: Path) -> None:
    src = source(llama_dir, tmp_path)
    (src / "model.safetensors").unlink()
    refused(compile_dir(src, tmp_path), "no safetensors weights", "model.safetensors")


def test_truncated_checkpoint(llama_dir: Path, tmp_path: Path) -> None:
    src = source(llama_dir, tmp_path)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) - 100])
    refused(compile_dir(src, tmp_path), "model.safetensors")


def test_pickle_checkpoint_is_named(llama_dir: Path, tmp_path: Path) -> None:
    src = source(llama_dir, tmp_path)
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    refused(compile_dir(src, tmp_path), "pytorch_model.bin", "pickle")


def gptq_repo(llama_dir: Path, tmp_path: Path) -> Path:
    """An older GPTQ repository: ``quantize_config.json`` only (no ``quantization_config`` in
    config.json), every ``*_proj.weight`` stored as ``qweight/qzeros/scales/g_idx``."""
    src = source(llama_dir, tmp_path)
    tensors = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if not name.endswith("_proj.weight"):
            out[name] = t
            continue
        n, k = t.shape
        base = name.removesuffix(".weight")
        out[f"{base}.qweight"] = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=gen)
        out[f"{base}.qzeros"] = torch.full((k // 32, n // 8), 0x77777777, dtype=torch.int32)
        out[f"{base}.scales"] = (torch.rand(k // 32, n, generator=gen) * 0.01).to(torch.float16)
        out[f"{base}.g_idx"] = torch.arange(k, dtype=torch.int32) // 32
    save_file(out, src / "model.safetensors", metadata={"format": "pt"})
    (src / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32, "desc_act": False, "sym": True}))
    return src


def test_old_gptq_repository_is_read_as_stored_not_randomised(llama_dir: Path, tmp_path: Path) -> None:
    """The silent-data-loss case: transformers reports the GPTQ tensors unexpected and every
    projection missing, and would initialise them randomly. The GPTQ reader reads them instead:
    every projection decodes to ``scales * (q - 8)`` of its own stored nibbles, and ``--scheme``
    (a requantization) is refused by name."""
    src = gptq_repo(llama_dir, tmp_path)
    refused(compile_dir(src, tmp_path), "already quantized (gptq)", "--scheme w4-g32")
    out = tmp_path / "out"
    # the f32 model keeps f32 scales in compressed-tensors: widening the f16 scales is a (lossless) conversion
    r = run_cli("compile", str(src), "--target", "safetensors", "-o", str(out), "--allow-conversion")
    assert r.code == 0, r.err
    stored = load_file(src / "model.safetensors")
    m = open_artifact(out).module
    seen = 0
    for name, op, t in weights(m):
        base = name.removesuffix(".weight")
        words = stored[f"{base}.qweight"].numpy().view(np.uint32)  # [K/8, N]: 8 nibbles along K
        q = np.stack([(words >> (4 * j)) & 15 for j in range(8)], axis=1).reshape(-1, words.shape[1])
        s = stored[f"{base}.scales"].numpy().astype(np.float32)  # [K/32, N]
        want = ((q.astype(np.float32) - 8) * np.repeat(s, 32, axis=0)).T
        assert np.array_equal(decoded(m, op, t), want), name
        seen += 1
    assert seen == sum(1 for n in stored if n.endswith(".qweight"))


def test_unexpected_tensor_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    """Any directory whose tensor names do not match the architecture: one extra tensor is enough."""
    src = source(llama_dir, tmp_path)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    refused(compile_dir(src, tmp_path), "not taken by the model", "extra_proj")


def test_reshaped_tensor_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    src = source(llama_dir, tmp_path)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name] = tensors[name].reshape(-1, 32).contiguous()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    refused(compile_dir(src, tmp_path), name)


def test_good_directory_still_compiles_and_records_nothing_dropped(llama_dir: Path, tmp_path: Path) -> None:
    r = compile_dir(source(llama_dir, tmp_path), tmp_path)
    assert r.code == 0, r.err


def write_factory(tmp_path: Path, body: str) -> str:
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "factories.py").write_text(body)
    sys.path.insert(0, str(tmp_path))
    return "userpkg.factories:make"


def test_factory_that_raises(tmp_path: Path) -> None:
    spec = write_factory(tmp_path, "def make():\n    raise ValueError('no such checkpoint on this machine')\n")
    try:
        r = run_cli("compile", spec, "--target", "safetensors", "-o", str(tmp_path / "out"))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("userpkg.factories", None)
        sys.modules.pop("userpkg", None)
    refused(r, spec, "ValueError", "no such checkpoint", "QC_DEBUG=1")


def test_model_that_torch_export_cannot_capture(tmp_path: Path) -> None:
    body = (
        "import torch\n"
        "from qcompiler.frontend.hf import Capturable\n"
        "class Bad(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        raise RuntimeError('forward is broken')\n"
        "def make():\n"
        "    return Capturable(Bad(), (torch.ones(2, 3),))\n"
    )
    spec = write_factory(tmp_path, body)
    try:
        r = run_cli("compile", spec, "--target", "safetensors", "-o", str(tmp_path / "out"))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("userpkg.factories", None)
        sys.modules.pop("userpkg", None)
    refused(r, "torch.export cannot capture Bad", "forward is broken")


@pytest.mark.parametrize("tokens", ["5,99999", "5,-3", "5,128"])
def test_run_tokens_outside_the_vocabulary(artifact: Path, tokens: str) -> None:
    refused(run_cli("run", str(artifact), "--tokens", tokens), "token")


def test_run_negative_max_new_tokens(artifact: Path) -> None:
    refused(run_cli("run", str(artifact), "--tokens", "1,2", "--max-new-tokens", "-5"), "--max-new-tokens")


def test_opt_non_utf8_ir(tmp_path: Path) -> None:
    path = tmp_path / "bad.qir"
    path.write_bytes(b"module @m {\n  // \xff\xfe\n}\n")
    refused(run_cli("opt", str(path)), "bad.qir", "not UTF-8")


def test_opt_deeply_nested_ir(tmp_path: Path) -> None:
    path = tmp_path / "deep.qir"
    path.write_text("module @m attributes {a = " + "[" * 3000 + "]" * 3000 + "} {\n}\n")
    r = run_cli("opt", str(path))
    refused(r, "deep.qir", "nested deeper than")
    assert len(r.err.splitlines()) <= 4


def test_manifest_nested_deep_is_refused_before_it_is_parsed(artifact: Path, tmp_path: Path) -> None:
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    text = json.dumps(manifest)[:-1] + ', "deep": ' + "[" * 1000 + "]" * 1000 + "}"
    (art / "manifest.json").write_text(text)
    r = run_cli("verify", str(art))
    assert r.code == 1
    assert "nested too deep" in r.out + r.err
    assert "Traceback" not in r.out + r.err


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("parity",), []),
        (("parity", "rung2_reconstruction", "decode_blake3"), "x"),
        (("topology", "tp"), "two"),
        (("versions", "packing_layout"), ["ggml/v1"]),
    ],
)
def test_malformed_manifest_fields_are_typed(
    artifact: Path, tmp_path: Path, path: tuple[str, ...], value: object
) -> None:
    """Fields readers interpret, changed (and the manifest's own digest recomputed): refused by the
    schema or the derived-fields gate, never an AttributeError further on."""
    from qcompiler.artifact.writer import SELF_DIGEST, manifest_digest

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    manifest[SELF_DIGEST] = manifest_digest(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    r = run_cli("verify", str(art), "--json")
    assert r.code == 1
    result = json.loads(r.out)
    assert result["ok"] is False
    assert "manifest.json" in result["error"]
    assert path[-1] in result["error"]


def test_a_deleted_max_shard_size_is_refused(artifact: Path, tmp_path: Path) -> None:
    """A shardable target records the limit it sharded by; deleting it (digest recomputed) is refused."""
    from qcompiler.artifact.writer import SELF_DIGEST, manifest_digest

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    del manifest["topology"]["max_shard_size"]
    manifest[SELF_DIGEST] = manifest_digest(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    r = run_cli("verify", str(art), "--json")
    assert r.code == 1
    assert "topology.max_shard_size" in json.loads(r.out)["error"]


def test_added_tokenizer_file_must_match_tokenizer_sha256(artifact: Path, tmp_path: Path) -> None:
    """A tokenizer file slipped into an artifact (and listed, as a careless tool would) disagrees
    with the manifest's ``tokenizer_sha256``: transformers would read it, so it is refused."""
    import hashlib

    from qcompiler.artifact.writer import SELF_DIGEST, manifest_digest

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    data = b'{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}}}'
    (art / "tokenizer.json").write_bytes(data)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"].append({"path": "tokenizer.json", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest[SELF_DIGEST] = manifest_digest(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    r = run_cli("verify", str(art), "--json")
    assert r.code == 1
    assert "tokenizer" in json.loads(r.out)["error"]


def test_compile_into_a_directory_of_user_files_is_refused_and_leaves_them(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    r = run_cli("compile", LLAMA, "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out))
    refused(r, str(out), "--force")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mine.tmp")]


def test_unwritable_output_is_a_user_error_naming_the_path(tmp_path: Path) -> None:
    """A path under a regular file cannot be created (ENOTDIR even for root)."""
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "art"
    r = run_cli("compile", LLAMA, "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out))
    refused(r, str(tmp_path / "file"))
    assert "emit-container" not in r.err


def test_console_script_reports_typed_errors_without_traceback(llama_dir: Path, tmp_path: Path) -> None:
    """The same, through the installed console script, for a source, an artifact and an IR file."""
    exe = shutil.which("qcompiler")
    assert exe is not None
    src = gptq_repo(llama_dir, tmp_path)
    (src / "quantize_config.json").write_text(json.dumps({"bits": 3, "group_size": 32}))  # 3-bit GPTQ: not read
    bad_ir = tmp_path / "bad.qir"
    bad_ir.write_bytes(b"\xff")
    for argv in (
        ["compile", str(src), "--target", "safetensors", "-o", str(tmp_path / "o")],
        ["verify", str(tmp_path)],
        ["opt", str(bad_ir)],
    ):
        r = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=300)
        both = r.stdout + r.stderr
        assert r.returncode == 1, both
        assert "Traceback" not in both, both
        assert "Warning" not in both, both
        assert "error: " in both, both


def test_untyped_exception_is_an_internal_error_with_a_rerun_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backstop: an exception qcompiler did not type (here planted in a command) is reported in
    one paragraph naming its type and where it came from, exit 2, with the QC_DEBUG=1 command."""
    import qcompiler.cli.inspect as inspect_cmd

    def broken(_args: object) -> int:
        return int(np.array([1, 2]))  # a TypeError from numpy, as an untyped bug would raise

    monkeypatch.setattr(inspect_cmd, "run", broken)
    r = run_cli("inspect", "somewhere")
    assert r.code == 2
    assert "Traceback" not in r.err
    assert r.err.startswith("error: internal error: TypeError at test_bad_input.py:")
    assert "QC_DEBUG=1 qcompiler inspect somewhere" in r.err
    monkeypatch.setenv("QC_DEBUG", "1")
    with pytest.raises(TypeError):
        run_cli("inspect", "somewhere")
