"""The verifier refuses what a careless (or fuzzing) tool can write into an artifact's graph.qir.

Each case edits a compiled artifact's graph.qir, re-hashes the manifest's file list as such a tool
would, and runs ``qcompiler verify --json``: the artifact is refused with a typed error (never an
internal error) naming the op or tensor and the field. Before these checks each edit was accepted,
or (a ``?`` in a qparam's shape) crashed with ``ValueError``. The untouched artifact still passes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qcompiler.ir.descriptor import rate_claim
from qcompiler.ir.invariants import INVARIANTS
from qcompiler.ir.parser import parse_type
from qcompiler.ir.types import QuantType
from qcompiler.passes import get_pass_class, pass_names
from qcompiler.testing import rehash, run_cli

Q_PROJ = "%model_layers_0_self_attn_q_proj_weight = q.weight"
Q_PROJ_TYPE = (
    "qparams={scale: f32[64,2]}, decoder=1, pack=(family=ct-pack-quantized, version=1, "
    "encoding=offset-binary-lsb, tile=[1,1]), req=linear, "
    "rate=(bits=20480, per=4096, unit=weight, scope=tensor, incl=[codes, scale])>"
)
EMBED = "tensor @model.embed_tokens.weight"
MODULE = "module @tiny_llama_hf"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("strict") / "art"
    r = run_cli(
        "compile", "qcompiler.examples:tiny_llama_hf", "--scheme", "w4-g32", "--target", "safetensors", "-o", str(out)
    )
    assert r.code == 0, r.err
    return out


def verify_edited(src: Path, tmp_path: Path, old: str, new: str) -> dict[str, object]:
    art = tmp_path / "art"
    shutil.copytree(src, art)
    text = (art / "graph.qir").read_text()
    assert old in text, old
    (art / "graph.qir").write_text(text.replace(old, new, 1))
    rehash(art)
    r = run_cli("verify", str(art), "--json")
    assert "internal error" not in r.err, r.err
    return json.loads(r.out)


def test_the_untouched_artifact_verifies(llama: Path) -> None:
    r = run_cli("verify", str(llama), "--json")
    assert json.loads(r.out)["ok"] is True, r.out


CASES = [
    # 1. static shapes: a '?' in a qparam's shape was a ValueError in check_binding
    pytest.param(
        Q_PROJ_TYPE, Q_PROJ_TYPE.replace("f32[64,2]", "f32[64,?]"), Q_PROJ, "rate", "static", id="slot-dyn-rate"
    ),
    pytest.param(
        Q_PROJ_TYPE,
        Q_PROJ_TYPE.replace("f32[64,2]", "f32[64,?]").split(", rate=")[0] + ">",
        Q_PROJ,
        "scale",
        "static shape",
        id="slot-dyn",
    ),
    pytest.param("f32[64,64], unit=element", "f32[64,?], unit=element", Q_PROJ, "rate", "static", id="weight-dyn"),
    # 2. tensor and module attributes
    pytest.param(
        'placement = "replicate"', 'placement = "bogus"', EMBED, "placement", "unknown placement", id="placement"
    ),
    pytest.param("file_shard = 1", "file_shard = 0", EMBED, "file_shard", "1..1", id="file-shard-0"),
    pytest.param("file_shard = 1", "file_shard = 2147483648", EMBED, "file_shard", "1..1", id="file-shard-big"),
    pytest.param("file_shard = 1", "file_shard = -inf", EMBED, "file_shard", "1..1", id="file-shard-inf"),
    pytest.param("file_shard = 1", "shard = 1", EMBED, "shard", "unknown tensor attribute", id="tensor-attr"),
    pytest.param(
        'role = "constant"', 'role = "weights"', "tensor @model.rotary_emb.inv_freq", "role", "role", id="role"
    ),
    pytest.param('qdq_form = "fold"', 'qdq_form = "Infinity"', MODULE, "qdq_form", "fold | materialize", id="qdq"),
    pytest.param("count = 1, max_size", "count = 0, max_size", MODULE, "file_shards.count", ">= 1", id="count"),
    pytest.param("max_size = 5000000000", "max_size = -5", MODULE, "file_shards.max_size", ">= 1", id="max-size"),
    pytest.param("topology = {tp = 1, pp = 1}", "topology = {tp = 0, pp = 1}", MODULE, "topology.tp", ">= 1", id="tp"),
    pytest.param("topology = {tp = 1, pp = 1}", "topology = {tp = 1}", MODULE, "topology", "fields", id="topology"),
    pytest.param('"qdq-fused"]', '"qdq-fused", "qdq-fused"]', MODULE, "invariants", "twice", id="inv-twice"),
    pytest.param('"qdq-fused"]', '"qdq-fused", "fast"]', MODULE, "invariants", "unknown invariant", id="inv-unknown"),
    # 3. rate claims are recomputed
    pytest.param("per=4096, unit", "per=127, unit", Q_PROJ, "rate", "bits=20480, per=4096", id="rate-per"),
    pytest.param("bits=20480, per=4096", "bits=18432, per=4096", Q_PROJ, "rate", "bits=20480", id="rate-bits"),
    # 4. the expressed dtype is the one q.linear computes in
    pytest.param("f32[64,64], unit=element", "f64[64,64], unit=element", "%linear = q.linear", "w", "f64", id="f64"),
    # 5. attribute ranges the interpreter and the backends rely on
    pytest.param(
        '["?batch", "?seq", 4, 16]}', '["?batch", "?seq", -4, 16]}', "%view = reshape", "shape", ">= 0", id="reshape"
    ),
    pytest.param(
        '{shape = ["?batch", 2, 2, "?seq", 16]}',
        '{shape = ["?batch", -2, 2, "?seq", 16]}',
        "%expand = expand",
        "shape",
        ">= -1",
        id="expand",
    ),
    pytest.param(
        "mean(%pow_1) {axes = [-1]", "mean(%pow_1) {axes = [-1, 2]", "%mean_1 = mean", "axes", "twice", id="axes"
    ),
    pytest.param("%c_2 = full() {value = 2.0", "%c_2 = full() {value = nan", "%c_2 = full", "value", "NaN", id="nan"),
    pytest.param(
        "%input_ids: tensor<i64[?batch,?seq]>",
        "%input_ids: tensor<i64[?batch,4611686018427387904,4]>",
        "%input_ids",
        "type",
        "overflows int64",
        id="numel",
    ),
]


@pytest.mark.parametrize(("old", "new", "where", "field", "says"), CASES)
def test_edited_graph_is_refused_by_name(
    llama: Path, tmp_path: Path, old: str, new: str, where: str, field: str, says: str
) -> None:
    result = verify_edited(llama, tmp_path, old, new)
    assert result["ok"] is False
    error = str(result["error"])
    assert f"{where}: {field}: " in error, error
    assert says in error, error


def test_known_invariants_are_the_passes_establishes() -> None:
    """The verifier's invariant table is exactly what the passes can establish: a pass cannot claim
    a name the verifier would refuse, and the verifier knows no name no pass establishes."""
    classes = [get_pass_class(p) for p in pass_names()]
    established = {name for cls in classes if cls is not None for name in cls.establishes}
    assert established == set(INVARIANTS)


def test_rate_claim_counts_every_part() -> None:
    """``rate_claim`` (what ``describe`` writes and the verifier recomputes): codes at the code width,
    slots at their dtype's, counted per weight, row or block."""
    t = parse_type(
        "!q.affine<i4[-8:7] -> f32[64,96], unit=element, rev=1, group=(axis=1, size=32, tail=partial), "
        "qparams={scale: f16[64,3], zero: i8[64,3]}, perm=i32[96], decoder=1, "
        "pack=(family=logical, version=1, encoding=none, tile=[1,1]), req=linear>"
    )
    assert isinstance(t, QuantType)
    r = rate_claim(t, ("codes", "scale", "zero", "perm"))
    assert (r.bits, r.per) == (6144 * 4 + 192 * 16 + 192 * 8 + 96 * 32, 6144)
    assert rate_claim(t, ("codes",), unit="row").per == 64
    assert rate_claim(t, ("codes",), unit="block").per == 192
