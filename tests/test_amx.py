"""lamina's int8 and bfloat16 panel products on AMX tiles (pyx/amx_tiles.h, the kernels' path
'amx'): the same int32 sums as the AVX-512 VNNI kernel, so the same int8 outputs bit for bit, and
bfloat16 products within float32 accumulation of the float64 product of the rounded operands, at
every edge of a tile. Each path runs in a process of its own (LAMINA_ISA picks it when lamina is
imported). On a CPU without AMX these tests skip; the other paths are tested everywhere
(test_isa.py)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from lamina.backends.cpu.compiled import NEEDS
from lamina.processor import instruction_sets

pytestmark = pytest.mark.skipif(not NEEDS["amx"] <= set(instruction_sets()),
                                reason="this CPU has no AMX (AMX-TILE, AMX-BF16, AMX-INT8)")

# rows, depth, channels: whole tiles and the rows short of one (16 + 5), two rows of tiles and
# several blocks of rows (150), an odd number of panels and one of fewer than 16 channels (37),
# depths that pad to whole tiles (1, 100, 257) or are whole tiles (64, 256) or deep (4099)
SHAPES = [(16, 64, 16), (21, 1, 70), (37, 100, 37), (150, 257, 37), (64, 256, 1024), (33, 4099, 20)]

SCRIPT = """
import sys
import numpy as np
import lamina as lm
from lamina.backends.cpu import compiled
be = lm.CPUBackend("openblas", "lamina")
rng = np.random.default_rng(3)
out = {"path": np.array(compiled.PATH), "amx": np.array(compiled._kernels.amx_runs())}
for m, k, n in %(shapes)r:
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    out.update({f"a {m} {k} {n}": a, f"w {m} {k} {n}": w, f"bias {m} {k} {n}": bias})
    for precision in ("int8", "bfloat16"):
        c = np.empty((m, n), np.float32)
        be.packed_gemm_bias(a, be.pack(w, True, 1.0, m, precision=precision), c, bias)
        out[f"{precision} {m} {k} {n}"] = c
    c = np.full((m, n), 0.5, np.float32)
    be.gemm_in("bfloat16", np.ascontiguousarray(a.T), w, c, trans_a=True, trans_b=True, alpha=2.0, beta=3.0)
    out[f"gemm_in {m} {k} {n}"] = c
lm.manual_seed(0)
net = lm.Network()
x = net.input("x", 24, sequence=True)
h = lm.layers.LSTM(24, 48, num_layers=2)(x)[0]
net.outputs(y=lm.layers.Linear(48, 5)(h))
quantized = lm.quantize(net)
lengths = [30] * 5 + list(rng.integers(1, 30, size=35))
seqs = lm.Sequences.from_list([rng.standard_normal((t, 24)).astype(np.float32) for t in lengths])
for threads in (1, 2):
    lm.set_num_threads(threads)
    out[f"lstm {threads}"] = quantized.run({"x": seqs})["y"].values
np.savez(sys.argv[1], **out)
"""


def _run(path, tmp_path):
    file = tmp_path / f"{path}.npz"
    script = tmp_path / "products.py"
    script.write_text(SCRIPT % {"shapes": SHAPES})
    env = {**os.environ, "LAMINA_ISA": path, "LAMINA_LOW_PRECISION": "lamina"}  # (lamina's panels on both)
    proc = subprocess.run([sys.executable, str(script), str(file)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(file))


@pytest.fixture(scope="module")
def on_both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("amx")
    return _run("amx", tmp), _run("avx512", tmp)


def test_the_amx_path_runs_the_tiles_and_the_avx512_path_does_not(on_both):
    amx, vectors = on_both
    assert (str(amx["path"]), bool(amx["amx"])) == ("amx", True)
    assert (str(vectors["path"]), bool(vectors["amx"])) == ("avx512", False)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_products_on_amx_tiles_equal_the_vnni_kernels(on_both, m, k, n):
    """tdpbusd and vpdpbusd sum the same u8 x s8 products in int32, exactly: the outputs, which
    the same float32 steps make of those sums, are equal bit for bit."""
    amx, vectors = on_both
    np.testing.assert_array_equal(amx[f"int8 {m} {k} {n}"], vectors[f"int8 {m} {k} {n}"])


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_bfloat16_products_on_amx_tiles_within_float32_accumulation(on_both, m, k, n):
    """Both paths within k float32 roundings of the float64 product of the rounded operands (the
    two sum in different orders), for a packed weight with a bias and for gemm_in with op(a) read
    from a's columns, alpha and beta."""
    from lamina.precision import round_bfloat16
    amx, vectors = on_both
    a, w, bias = (amx[f"{name} {m} {k} {n}"] for name in ("a", "w", "bias"))
    np.testing.assert_array_equal(a, vectors[f"a {m} {k} {n}"])
    ra, rw = round_bfloat16(a).astype(np.float64), round_bfloat16(w).astype(np.float64)
    exact = ra @ rw.T
    bound = k * 2.0 ** -24 * (np.abs(ra) @ np.abs(rw.T)) * 1.01
    for found in (amx, vectors):
        c = found[f"bfloat16 {m} {k} {n}"]
        assert np.all(np.abs(c - (exact + bias)) <= bound + 2 * 2.0 ** -24 * np.abs(c))
        c = found[f"gemm_in {m} {k} {n}"]
        assert np.all(np.abs(c - (2 * exact + 1.5)) <= 2 * bound + 4 * 2.0 ** -24 * np.abs(c))


def test_a_quantized_lstm_gives_the_same_outputs_on_amx_tiles(on_both):
    """A quantized two-layer LSTM and Linear over 40 sequences of 1 to 30 steps (steps of 40 rows,
    two whole tiles and 8 rows, down to 5), on one and two threads: the same outputs on both
    paths, bit for bit."""
    amx, vectors = on_both
    for threads in (1, 2):
        np.testing.assert_array_equal(amx[f"lstm {threads}"], vectors[f"lstm {threads}"])
        assert np.isfinite(amx[f"lstm {threads}"]).all()
