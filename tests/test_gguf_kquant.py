"""Q4_K, Q5_K and Q6_K quantize against ggml's C reference quantizer, and their round trip.

- the oracle is ``ggml_quantize_chunk`` from the ``libggml-base`` that llama-cpp-python bundles, with no
  importance matrix (so ggml runs ``quantize_row_q{4,5,6}_K_ref``): our bytes must equal its bytes on
  N(0,1) rows, heavy-tailed (Student-t) rows and edge rows. llama-cpp-python ships as source only;
  the test command (.ci/run) builds and installs it;
- always: ``dequantize(quantize(x))`` equals gguf-py's dequantize of the same bytes, the round-trip
  RMSE on N(0,1) is what ggml's quantizers reach, and blocks do not depend on their neighbours.
"""

from __future__ import annotations

import ctypes
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
import pytest
from gguf import quants

from qcompiler.backends.gguf.codecs import get_codec
from qcompiler.backends.gguf.ggml_types import GGMLType, row_bytes

Array = npt.NDArray[Any]
K_QUANTS = [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
ORACLE_MISSING = "llama-cpp-python (the C oracle) is not installed: run the test command, .ci/run, which builds it"
RMSE = {GGMLType.Q4_K: 0.071, GGMLType.Q5_K: 0.036, GGMLType.Q6_K: 0.018}
"""Round-trip RMSE of ggml's reference quantizers on N(0,1) (measured with the C oracle)."""
N = 1024  # four super-blocks per row


def ids(t: GGMLType) -> str:
    return t.name


@cache
def ggml_base() -> ctypes.CDLL | None:
    """llama-cpp-python's ``libggml-base`` with ``ggml_quantize_chunk`` typed; None if not installed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    libdir = Path(spec.origin).parent / "lib"
    found = sorted(libdir.glob("libggml-base.so")) + sorted(libdir.glob("*ggml-base*.dylib"))
    found += sorted(libdir.glob("*ggml-base*.dll"))
    assert found, f"llama-cpp-python is installed but {libdir} has no libggml-base"
    lib = ctypes.CDLL(str(found[0]))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p]
    return lib


@pytest.fixture
def oracle() -> ctypes.CDLL:
    lib = ggml_base()
    assert lib is not None, ORACLE_MISSING  # the test command installs llama-cpp-python
    return lib


def c_quantize(lib: ctypes.CDLL, t: GGMLType, x: Array) -> Array:
    """``ggml_quantize_chunk(t, x, dst, 0, rows, n, NULL)``: ggml's reference bytes of ``x``."""
    src = np.ascontiguousarray(x, dtype=np.float32)
    dst = np.zeros((src.shape[0], row_bytes(t, src.shape[1])), dtype=np.uint8)
    size = lib.ggml_quantize_chunk(int(t), src.ctypes.data, dst.ctypes.data, 0, src.shape[0], src.shape[1], None)
    assert size == dst.size
    return dst


def edge_rows() -> Array:
    """Zero, constant and single-value super-blocks, extremes of magnitude (tiny, subnormal, 6e4),
    alternating signs, ties, and sub-blocks whose scales span many decades (so that some round to a
    6-bit sub-scale of 0, where ggml keeps the search's codes)."""
    rng = np.random.default_rng(11)
    z = np.zeros(N, dtype=np.float32)
    one, alt = z.copy(), np.where(np.arange(N) % 2 == 0, 1.0, -1.0)
    one[37] = 2.5
    decades = np.repeat(10.0 ** rng.uniform(-6, 3, N // 16), 16)
    rows = [
        z,
        -z,
        z + 0.3,
        z - 7.0,
        one,
        -one,
        z + 1e-30,
        alt * 1e-30,
        rng.standard_normal(N) * 1e-40,  # subnormal: the searches' scales overflow to inf
        z + 6e4,
        alt * 6e4,
        rng.uniform(-6e4, 6e4, N),
        alt,
        np.resize(np.arange(32) / 2 - 7.5, N),  # exact halves
        rng.standard_normal(N) * decades,
        np.abs(rng.standard_normal(N)) + 5.0,  # all positive: the min clamps to 0
        -np.abs(rng.standard_normal(N)) * decades,  # all negative
        rng.standard_normal(N) * (rng.random(N) < 0.05),  # sparse
    ]
    return np.stack(rows).astype(np.float32)


def cases() -> dict[str, Array]:
    rng = np.random.default_rng(0)
    return {
        "normal": rng.standard_normal((16, N)).astype(np.float32),
        "student_t": rng.standard_t(2.0, (16, N)).astype(np.float32),
        "edges": edge_rows(),
    }


@pytest.mark.parametrize("t", K_QUANTS, ids=ids)
def test_quantize_matches_ggml_c_reference(t: GGMLType, oracle: ctypes.CDLL) -> None:
    codec = get_codec(t)
    for name, x in cases().items():
        ours, ref = codec.quantize(x), c_quantize(oracle, t, x)
        assert ours.shape == ref.shape, name
        bad = np.argwhere(ours != ref)
        assert bad.size == 0, f"{name}: {len(bad)} bytes differ, first at (row, byte) {tuple(bad[0])}"


@pytest.mark.parametrize("t", K_QUANTS, ids=ids)
def test_round_trip_matches_gguf_py(t: GGMLType) -> None:
    codec = get_codec(t)
    for name, x in cases().items():
        blob = codec.quantize(x)
        ours = codec.dequantize(blob)
        ref = np.asarray(quants.dequantize(blob, gguf.GGMLQuantizationType(int(t))), dtype=np.float32)
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), name
        assert np.isfinite(ours).all(), name
    zeros = np.zeros((2, N), dtype=np.float32)
    assert np.array_equal(codec.dequantize(codec.quantize(zeros)), zeros)


@pytest.mark.parametrize("t", K_QUANTS, ids=ids)
def test_round_trip_error_is_ggml_s(t: GGMLType) -> None:
    codec = get_codec(t)
    x = np.random.default_rng(1).standard_normal((64, 4096)).astype(np.float32)
    y = quants.dequantize(codec.quantize(x), gguf.GGMLQuantizationType(int(t)))
    rmse = float(np.sqrt(np.mean((np.asarray(y, dtype=np.float64) - x) ** 2)))
    assert RMSE[t] * 0.85 <= rmse <= RMSE[t] * 1.15, f"{t.name}: RMSE {rmse:.4f}, expected about {RMSE[t]}"


@pytest.mark.parametrize("t", K_QUANTS, ids=ids)
def test_blocks_are_independent(t: GGMLType) -> None:
    """A super-block's bytes depend on its own 256 values only: rows quantized alone, in another
    order or regrouped into other row lengths give the same blocks."""
    codec = get_codec(t)
    x = edge_rows()
    blob = codec.quantize(x)
    perm = np.random.default_rng(2).permutation(len(x))
    assert np.array_equal(codec.quantize(x[perm]), blob[perm])
    assert np.array_equal(np.concatenate([codec.quantize(r[None]) for r in x]), blob)
    assert np.array_equal(codec.quantize(x.reshape(-1, 256)).reshape(blob.shape), blob)
