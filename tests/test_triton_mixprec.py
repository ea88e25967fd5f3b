"""The mixed 2/4-bit Triton kernels (``mixprec`` layout: 2-bit and 4-bit groups, fp16 outliers, second-level
quantized scales) without a GPU: on Triton's CPU interpreter every kernel matches the float64 product with
the float32 reference decode (kernel error apart from quantization error, bounds as ``parity`` states
them), each stream the kernel reads is shown to matter, the planes round-trip, the sources are
deterministic and compile ahead of time for sm_80 and sm_90, and the admission predicate refuses by name."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from qcompiler.backends.triton.aot import SHARED_LIMIT, TARGETS
from qcompiler.backends.triton.mixprec_codegen import (
    LAYOUT,
    MixKey,
    admit_mixprec,
    generate_mixprec,
    shared_estimate,
)
from qcompiler.backends.triton.mixprec_run import (
    MixWeight,
    compile_mixprec,
    pack_planes,
    prepare,
    random_weight,
    run_mixprec,
    unpack_planes,
)
from qcompiler.backends.triton.runtime import ERROR_BOUND
from qcompiler.runtime.rungs import rel

CPU = torch.device("cpu")
TORCH = {"f16": torch.float16, "f32": torch.float32}
ROWS = [(1, "decode", 8), (5, "decode", 8), (5, "decode", 0), (16, "decode", 8), (33, "prefill", 8)]
"""(M, phase, SMs): the decode splits K over 8 SMs, and with 0 SMs it runs one slice (``SPLIT_K = 1``)."""
A100 = {"max_shared_bytes": 163 * 1024, "registers_per_thread": 255, "registers_per_sm": 65536}
SLOTS = ("codes", "zero", "scale_codes", "scale2", "zero2", "rowptr", "col", "value")

CASES = [
    (MixKey("f32", "f32", 64, 32), 72),  # N past the second-level groups' multiple (ceil(N / G2) = 3)
    (MixKey("f16", "f16", 64, 32), 300),  # three N tiles, the last partial: hbase per tile, tn per tile
    (MixKey("f16", "f32", 128, 16, bias=True), 48),
    (MixKey("f16", "f16", 32, 64, outliers=False), 40),  # no outliers: the correction is not emitted
]


def weight(key: MixKey, n: int, k: int = 256, seed: int = 0) -> tuple[MixWeight, np.ndarray]:
    return random_weight(n, k, key.group, key.group2, outlier_frac=0.01 if key.outliers else 0.0, seed=seed)


def errors(key: MixKey, w: MixWeight, wf: np.ndarray, h: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(kernel, kernel error vs the exact decode, quantization error of the decode vs the float weight)."""
    gen = torch.Generator().manual_seed(0)
    n, k = w.shape
    ref, fp = torch.from_numpy(w.decode()).double(), torch.from_numpy(wf).double()
    bias = torch.randn(n, generator=gen).to(TORCH[key.out]) if key.bias else None
    b64 = 0 if bias is None else bias.double()
    out: list[tuple[str, float, float]] = []
    for m, phase, sms in ROWS:
        x = torch.randn(m, k, generator=gen).to(TORCH[key.act])
        y = run_mixprec(key, phase, h | {"sms": sms}, x, bias).double()
        want = x.double() @ ref.T + b64
        name = f"{phase}[M={m}{', SPLIT_K=1' if not sms else ''}]"
        out.append((name, rel(y, want), rel(want, x.double() @ fp.T + b64)))
    return out


@pytest.mark.parametrize(("key", "n"), CASES, ids=lambda c: c.id if isinstance(c, MixKey) else str(c))
def test_kernels_match_the_reference_decode_on_the_interpreter(key: MixKey, n: int) -> None:
    w, wf = weight(key, n)
    assert len(w.wide)
    assert (len(w.col) > 0) == key.outliers
    h = prepare(key, w, CPU, interpret=True)
    bound = ERROR_BOUND[key.act]
    for name, rel_kernel, rel_quant in errors(key, w, wf, h):
        print(f"{key.id}.{name}: kernel error {rel_kernel:.2e} (bound {bound:.0e}), quantization error {rel_quant:.2e}")
        assert rel_kernel <= bound, f"{key.id}.{name}: kernel error {rel_kernel:.2e} > {bound:.0e}"
        assert rel_kernel < rel_quant / 10  # reported apart, and far below the quantization error


def corrupt(stream: str, t: torch.Tensor) -> None:
    """Change one entry of a kernel input in place."""
    if stream == "hi":
        t[0, 0] ^= 0b100  # one high-plane code of a 4-bit group
    elif stream == "lo":
        t[0, 0] ^= 0b1
    elif stream == "s2":
        t[0, 0] *= 2  # one second-level scale
    elif stream == "sc":
        t[0, 1] //= 2  # one first-level scale code
    else:
        t[0] *= 4  # one outlier value


@pytest.mark.parametrize("stream", ["hi", "lo", "s2", "sc", "val"])
def test_every_stream_the_kernel_reads_matters(stream: str) -> None:
    key = MixKey("f32", "f32", 64, 32)
    w, wf = weight(key, 64)
    h = prepare(key, w, CPU, interpret=True)
    h[stream] = h[stream].clone()
    corrupt(stream, h[stream])
    assert all(e > 10 * ERROR_BOUND["f32"] for _, e, _ in errors(key, w, wf, h))


def test_the_planes_round_trip() -> None:
    for seed in range(4):
        w, _ = random_weight(24, 128, 32, 8, seed=seed)
        lo, hi = pack_planes(w.codes, w.wide, 32)
        assert lo.shape == (24, 32)
        assert hi.shape == (len(w.wide), 8)
        assert np.array_equal(unpack_planes(lo, hi, w.wide, 24, 128, 32), w.codes)
    codes = np.array([[0, 1, 2, 3] * 8, [3, 2, 1, 0] * 4 + [15, 4, 8, 12] * 4], dtype=np.uint8)
    lo, hi = pack_planes(codes, np.array([1]), 32)  # group 1 (row 1) is 4-bit: LSB first in both planes
    assert lo[0, 0] == 0b11100100
    assert lo[1, 4] == 0b00000011
    assert hi[0, 4] == 0b11100111


def test_validate_refuses_what_the_kernel_cannot_read() -> None:
    w, _ = random_weight(16, 128, 32, 8, outlier_frac=0.02)
    r, c = 0, int(w.col[0])
    codes = w.codes.copy()
    codes[r, c] = (codes[r, c] + 1) % 4
    with pytest.raises(ValueError, match="zero base"):
        replace(w, codes=codes).validate()
    two_bit = sorted(set(range(16 * 4)) - set(w.wide.tolist()))[0]
    codes = w.codes.copy()
    codes[two_bit // 4, (two_bit % 4) * 32] = 7
    with pytest.raises(ValueError, match="exceeds its group's width"):
        replace(w, codes=codes).validate()
    with pytest.raises(ValueError, match="4-bit group"):
        replace(w, wide=np.union1d(w.wide, [c // 32])).validate()


def test_source_is_deterministic_specialised_and_in_the_async_order() -> None:
    key = MixKey("f16", "f16", 64, 32)
    src = generate_mixprec(key)
    assert src == generate_mixprec(MixKey("f16", "f16", 64, 32))
    for literal in ("g = k0 // 64", "h[:, None] * 16", "offs_n // 32", "N2 = (N + 31) // 32"):
        assert literal in src
    for absent in ("b_ptr", "tf32"):
        assert absent not in src
    assert "rp_ptr" not in generate_mixprec(replace(key, outliers=False))
    assert "b_ptr" in generate_mixprec(replace(key, bias=True))
    decode = src[src.index("def decode") : src.index("def reduce")]
    order = [decode.index(s) for s in ("lo = tl.load", "hi = tl.load", "sc = tl.load", "s1 = ", "w0 = ", "tl.dot")]
    assert order == sorted(order)  # code loads issued, then the scale decode, then the combine
    with pytest.raises(ValueError, match="multiple of 16"):
        generate_mixprec(MixKey("f16", "f16", 40, 32))


@pytest.mark.parametrize("key", [MixKey("f16", "f16", 64, 32), MixKey("bf16", "bf16", 128, 128, bias=True)])
def test_kernels_compile_ahead_of_time_for_sm80_and_sm90(key: MixKey) -> None:
    evidence = compile_mixprec(key)
    assert sorted(evidence["targets"]) == [f"sm_{cc}" for cc in TARGETS]
    for target, binaries in evidence["targets"].items():
        assert sorted(binaries) == ["decode[SPLIT_K=1]", "decode[SPLIT_K=4]", "prefill", "reduce"]
        for name, b in binaries.items():
            assert b["ptx_chars"] > 0
            assert len(b["cubin_sha256"]) == 64
            assert b["shared_bytes"] <= SHARED_LIMIT[int(target.removeprefix("sm_"))]
            assert b["shared_bytes"] <= shared_estimate(key, name.partition("[")[0])  # the estimate is an upper one


def test_admission_admits_and_refuses_by_name() -> None:
    key = MixKey("f16", "f16", 64, 32)

    def admit(**kw: Any) -> str | None:
        args: dict[str, Any] = {"layout": LAYOUT, "precisions": {2, 4}, "slots": SLOTS, "exceptions": "replacement"}
        args |= {"local_k": 4096, "device": A100}
        return admit_mixprec(key, **(args | kw))

    assert admit() is None
    assert admit(precisions={2}) is None
    refusals = {
        "is not ('mixprec', 1, 'planes-a16')": admit(layout=("mixprec", 2, "planes-a16")),
        "2 and 4-bit codes only": admit(precisions={2, 4, 8}),
        "nested qparams missing: scale2, zero2": admit(slots=("codes", "zero", "scale_codes")),
        "exception semantics 'correction'": admit(exceptions="correction"),
        "not a multiple of the vector width 64": admit(local_k=4096 + 32),
        "not a whole number of groups of 64": admit(local_k=4096 + 32, vector_k=32),
        "bytes of shared memory exceed": admit(device=A100 | {"max_shared_bytes": 48 * 1024}),
        "registers per thread exceed": admit(device=A100 | {"registers_per_thread": 64}),
        "registers, the SM has": admit(device=A100 | {"registers_per_sm": 16384}),
    }
    for expected, got in refusals.items():
        assert got is not None
        assert expected in got, got
