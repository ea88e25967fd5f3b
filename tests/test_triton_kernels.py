"""The generated Triton kernels without a GPU: every kernel of a signature matrix (W8/W4/W2, signed and
unsigned codes, symmetric and asymmetric, per channel and grouped, act order, fp16/fp32/bf16, bias)
is generated deterministically, passes operator parity on Triton's CPU interpreter against the
reference decoder (kernel error apart from quantization error), and compiles ahead of time for
sm_80 and sm_90. The ``triton-kn`` layout round-trips and commutes with tensor-parallel slicing."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcompiler.backends.triton.aot import SHARED_LIMIT, TARGETS, compile_key, variants
from qcompiler.backends.triton.codegen import KernelKey, generate, launch
from qcompiler.backends.triton.layouts import pack_kn, slice_packed, unpack_kn
from qcompiler.backends.triton.parity import kernel_parity
from qcompiler.backends.triton.runtime import split_k
from qcompiler.ir.dtypes import DTYPES
from qcompiler.ir.reference import decode
from qcompiler.ir.types import DenseType
from qcompiler.quant.describe import describe

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = sorted((ROOT / "golden" / "triton").glob("*.npz"))


def key(
    bits: int,
    group: int,
    *,
    op: str = "linear",
    signed: bool = True,
    zero: bool = False,
    perm: bool = False,
    act: str = "f32",
    scale: str = "",
    out: str = "",
    bias: bool = False,
) -> KernelKey:
    return KernelKey(op, bits, signed, group, zero, perm, act, scale or act, out or act, bias)


INTERPRETED = [
    key(4, 128, act="f16"),  # the headline W4 g128 fp16
    key(4, 32, zero=True, perm=True, bias=True),  # GPTQ act-order, asymmetric, fused bias
    key(8, 0, act="f16", bias=True),  # W8 per channel: scale applied in the epilogue
    key(2, 64, zero=True, act="f16", scale="f32"),  # W2, fp32 scales with fp16 activations
    key(4, 16, signed=False, zero=True),  # unsigned codes, smallest group
    key(8, 128, zero=True),
    key(2, 0, perm=True, act="f16"),
    key(4, 32, op="embedding", zero=True, perm=True),
    key(8, 0, op="embedding", act="f16"),
]
"""Signatures run on the interpreter (fp16/fp32: its bf16 arithmetic works on raw bits)."""
COMPILED_ONLY = [
    key(4, 128, act="bf16"),
    key(8, 0, zero=True, act="bf16", bias=True),
    key(4, 32, op="embedding", act="bf16"),
]
"""bf16 signatures: compiled for the GPU targets here, run on a GPU by bench/gpu_kernels.py."""


def weight_for(k: KernelKey, n: int, kdim: int, seed: int = 0) -> dict[str, Any]:
    """Stored arrays of a random weight for ``k``, its reference decode and a float weight near it."""
    rng = np.random.default_rng(seed)
    lo, hi = (-(1 << (k.bits - 1)), (1 << (k.bits - 1)) - 1) if k.signed else (0, (1 << k.bits) - 1)
    codes = rng.integers(lo, hi + 1, size=(n, kdim)).astype(np.int64)
    group = k.group or kdim
    scale = (rng.random((n, kdim // group)) * 0.05 + 0.01).astype(np.float32)
    zero = rng.integers(lo, hi + 1, size=scale.shape) if k.zero else None
    g_idx = rng.permutation(np.arange(kdim) // group) if k.perm else None
    logical = DenseType(DTYPES["f32"], (n, kdim))
    d = describe("w", codes, scale, zero, [1, group], lo, hi, logical, "linear", g_idx=g_idx)
    arrays = d.arrays
    decoded = decode(d.type, arrays).astype(np.float32)
    noise = (rng.random(decoded.shape) - 0.5) * np.repeat(scale, group, axis=1)
    stored_scale = arrays["scale"].astype({"f16": np.float16, "f32": np.float32, "bf16": np.float32}[k.scale])
    return {
        "codes": pack_kn(arrays["codes"], k.bits, k.offset),
        "scale": stored_scale,
        "zero": arrays.get("zero"),
        "perm": arrays.get("perm"),
        "decoded": decoded,
        "float": decoded + noise.astype(np.float32),
    }


@pytest.mark.parametrize("k", INTERPRETED, ids=lambda k: k.id)
def test_every_kernel_matches_the_reference_decoder_on_the_interpreter(k: KernelKey) -> None:
    w = weight_for(k, 48, 256)
    checks = kernel_parity(k, w["codes"], w["scale"], w["zero"], w["perm"], w["decoded"], w["float"])
    names = {c.kernel.split(".")[-1].partition("[")[0] for c in checks}
    assert names == ({"gather"} if k.op == "embedding" else {"decode", "prefill"})
    for c in checks:
        assert c.ok, f"{c.kernel}: kernel error {c.rel_kernel:.2e} > {c.bound:.0e}"
        # kernel error is reported apart from quantization error, and is far below it
        assert c.rel_quant is not None
        assert c.rel_kernel < c.rel_quant / 10


def test_kernel_error_is_caught_when_the_codes_are_wrong() -> None:
    k = key(4, 32)
    w = weight_for(k, 16, 64)
    broken = w["codes"].copy()
    broken[0, 0] ^= 0x10  # one code of column 0 changed
    checks = kernel_parity(k, broken, w["scale"], w["zero"], w["perm"], w["decoded"])
    assert not any(c.ok for c in checks)


def test_decode_splits_k_when_tiles_are_few() -> None:
    cfg = launch(key(4, 128, act="f16"))["decode"]
    assert split_k(1, 4096, 4096, 132, cfg) == 16  # 32 N tiles x 16 slices >= two waves on 132 SMs
    assert split_k(1, 14336, 4096, 132, cfg) == 4
    assert split_k(1, 64, 256, 8, cfg) == 2  # the interpreter's shapes take the split path too
    assert split_k(64, 4096, 4096, 132, cfg) == 4


@pytest.mark.parametrize("k", INTERPRETED + COMPILED_ONLY, ids=lambda k: k.id)
def test_every_kernel_compiles_ahead_of_time_for_sm80_and_sm90(k: KernelKey) -> None:
    evidence = compile_key(k)
    assert sorted(evidence["targets"]) == [f"sm_{cc}" for cc in TARGETS]
    for target, binaries in evidence["targets"].items():
        assert sorted(binaries) == sorted(name for name, _ in variants(k))
        for b in binaries.values():
            assert len(b["cubin_sha256"]) == 64
            assert b["shared_bytes"] <= SHARED_LIMIT[int(target.removeprefix("sm_"))]


def test_generated_source_is_deterministic_and_specialised() -> None:
    plain, rich = key(4, 128, act="f16"), key(4, 32, zero=True, perm=True, bias=True)
    assert generate(plain) == generate(plain)
    src = generate(plain)
    for absent in ("z_ptr", "p_ptr", "b_ptr", "tf32"):
        assert absent not in src
    assert "g = k0 // 128" in src
    assert "& 15) - 8" in src
    rich_src = generate(rich)
    for present in ("z_ptr", "p_ptr", "b_ptr", 'input_precision="tf32x3"'):
        assert present in rich_src
    assert generate(key(8, 0)).count("tl.load(s_ptr + offs_n") == 2  # per channel: scale in the epilogues


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    signed=st.booleans(),
    n=st.integers(1, 9),
    kb=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_triton_kn_round_trips_and_commutes_with_tp_slicing(
    bits: int, signed: bool, n: int, kb: int, seed: int
) -> None:
    per = 8 // bits
    kdim = kb * per * 2
    rng = np.random.default_rng(seed)
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    offset = 1 << (bits - 1) if signed else 0
    q = rng.integers(lo, hi + 1, size=(n, kdim))
    packed = pack_kn(q, bits, offset)
    assert packed.shape == (kdim // per, n)
    assert np.array_equal(unpack_kn(packed, bits, offset, kdim), q)
    a, b = sorted(rng.integers(0, n + 1, size=2))
    assert np.array_equal(slice_packed(packed, bits, 0, a, b), pack_kn(q[a:b], bits, offset))  # column parallel
    c, d = sorted(rng.integers(0, kdim // per + 1, size=2) * per)
    assert np.array_equal(slice_packed(packed, bits, 1, c, d), pack_kn(q[:, c:d], bits, offset))  # row parallel
    if per > 1:
        with pytest.raises(ValueError, match="multiples"):
            slice_packed(packed, bits, 1, 1, per + 1)


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_triton_kn_bytes_match_the_golden_vectors(path: Path) -> None:
    golden = np.load(path)
    bits, signed = int(path.stem[4:]), path.stem[3] == "i"
    offset = 1 << (bits - 1) if signed else 0
    codes = golden["codes"]
    assert len(np.unique(codes)) == 1 << bits  # every code of the width
    assert np.array_equal(pack_kn(codes, bits, offset), golden["packed"])
    assert np.array_equal(unpack_kn(golden["packed"], bits, offset, codes.shape[1]), codes)


def test_the_golden_vectors_are_what_their_script_writes() -> None:
    spec = importlib.util.spec_from_file_location("qc_triton_golden", ROOT / "golden" / "make_triton_golden.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cases = mod.cases()
    assert sorted(cases) == [p.stem for p in GOLDEN]
    for p in GOLDEN:
        golden = np.load(p)
        assert all(np.array_equal(golden[k], v) for k, v in cases[p.stem].items())
