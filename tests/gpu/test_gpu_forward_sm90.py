"""Hopper forward kernel (kernels_cu/hopper/fwd.cu) against the float64 reference.

Same criterion and harness as tests/gpu/test_gpu_forward.py (``run_case``: NaN-poisoned outputs,
fresh random inputs, max error <= 2x the naive same-dtype computation + floor), with the Hopper
kernel forced (``kernel="sm90"``: a ValueError if the planner would not take the call). Skipped
on GPUs other than compute capability 9.0. Also checks the planner's choice under "auto".
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from gpu_util import cp, hopper_only, launches_on_two_streams  # noqa: E402
from test_gpu_forward import run_case  # noqa: E402  (pytest puts tests/ on sys.path)

from cupyflash.gpu import plan_fwd_sm90  # noqa: E402
from cupyflash.gpu.tuning import TUNING
from cupyflash._options import Options  # noqa: E402


pytestmark = [pytest.mark.gpu, hopper_only]

DTYPES = ["float16", "bfloat16"]
HEAD_DIMS = [64, 128, 256]


def sm90(rng, *args, **kw):
    name = run_case(rng, *args, kernel="sm90", **kw)
    assert name.startswith("fwd90_"), name
    return name


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_headdim_grid(rng, dtype, d):
    sm90(rng, dtype, 2, 113, 203, 4, 2, d)
    sm90(rng, dtype, 1, 203, 113, 2, 1, d, causal=True)


SEQLENS = [(1, 239), (239, 1), (113, 203), (1023, 1024), (1024, 1023), (128, 128), (257, 63),
           (3, 3), (640, 2048)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q,s_k", SEQLENS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_seqlens(rng, dtype, d, s_q, s_k, causal):
    sm90(rng, dtype, 1, s_q, s_k, 2, 2, d, causal=causal)


OPTION_SETS = {
    "window": dict(window=(32, 16)),
    "window_left_only": dict(window=(50, -1)),
    "window_wide": dict(window=(300, 200)),
    "causal_top_left": dict(causal=True, bottom_right=False),
    "causal_window": dict(causal=True, window=(40, -1)),
    "softcap": dict(softcap=5.0),
    "softcap_causal": dict(softcap=30.0, causal=True),
    "softcap_negative_scale": dict(softcap=8.0, scale=-0.2),
    "scale": dict(scale=0.37),
}


@pytest.mark.parametrize("opt", list(OPTION_SETS))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_options(rng, dtype, d, opt):
    sm90(rng, dtype, 2, 157, 411, 4, 2, d, **OPTION_SETS[opt])


@pytest.mark.parametrize("h,h_k", [(8, 1), (8, 2), (6, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_mqa(rng, dtype, h, h_k):
    sm90(rng, dtype, 2, 130, 390, h, h_k, 128, causal=True)


@pytest.mark.parametrize("layout,pad", [("bhsd", 0), ("padded", 8), ("sstride", 0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(rng, dtype, layout, pad):
    sm90(rng, dtype, 2, 150, 170, 4, 2, 64, causal=True, layout=layout, pad=pad)
    sm90(rng, dtype, 1, 300, 290, 2, 1, 128, layout=layout, pad=pad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows(rng, dtype):
    sm90(rng, dtype, 1, 300, 100, 2, 1, 64, causal=True)            # rows before the diagonal
    sm90(rng, dtype, 1, 260, 110, 2, 2, 128, window=(0, 0))         # empty windows
    sm90(rng, dtype, 1, 200, 100, 2, 2, 64, window=(5, 3), bottom_right=False)
    sm90(rng, dtype, 1, 700, 100, 2, 2, 128, causal=True)            # whole query tiles see nothing


def test_long_sequence(rng):
    """Several pipeline wraps of the K/V ring and both consumers' turn-taking over many tiles."""
    sm90(rng, "bfloat16", 1, 2048, 4096, 2, 1, 128)
    sm90(rng, "float16", 1, 1500, 3001, 2, 2, 64, causal=True)


@pytest.mark.parametrize("ramp", [6.0, 40.0, -6.0, -40.0],
                         ids=["up6", "up40", "down6", "down40"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rising_scores(rng, dtype, causal, ramp):
    """Scores that grow along the keys (key j scaled by 1 + ramp·j / s_k; a negative ramp: towards
    key 0, the order in which the kernel walks the key tiles, right to left): the running max m
    keeps rising from key tile to key tile, by a little (6) or by more than 2^8 (40), so O and l
    are rescaled mid-row by large factors; random inputs alone move m mostly in the first key
    tile. The max-free softmax (MAXFREE, hd 128 × 128 keys) takes its exact path there, and with
    40 the max-free P overflows first. (A kernel that skips O's rescale fails every case.)"""
    sm90(rng, dtype, 1, 300, 1500, 2, 1, 64, causal=causal, key_ramp=ramp)
    sm90(rng, dtype, 1, 257, 2048, 2, 2, 128, causal=causal, key_ramp=ramp)


#: Key-tile widths at hd 128 that are not powers of two (FlashAttention-3 takes 176), forced
#: through an explicit Sm90Variant: ragged key tails, band edges that cut a tile anywhere.
WIDE_BN = [160, 176]
WIDE_OPTS = {"plain": {}, "causal": dict(causal=True), "window": dict(window=(100, 37)),
             "causal_top_left": dict(causal=True, bottom_right=False)}


@pytest.mark.parametrize("opt", list(WIDE_OPTS))
@pytest.mark.parametrize("s_q,s_k", [(1, 239), (113, 203), (257, 63), (640, 2048), (1023, 1024)])
@pytest.mark.parametrize("bn", WIDE_BN)
def test_wide_key_tiles(rng, bn, s_q, s_k, opt):
    kw = WIDE_OPTS[opt]
    var = plan_fwd_sm90.Sm90Variant("bf16_t", 128, bn, 2, bool(kw), False)
    name = run_case(rng, "bfloat16", 2, s_q, s_k, 2, 1, 128, kernel=var, **kw)
    assert name.startswith(f"fwd90_bf16_d128_128x{bn}s2"), name


# ---------------------------------------------------------------------------------------------
# The planner's choice under kernel="auto"
# ---------------------------------------------------------------------------------------------
def _auto_name(dtype, d, d_v=None, *, offset=0, layout="bshd", scale=None, **opts):
    """The kernel gpu.fwd.forward(kernel="auto") runs for a small problem of this kind."""
    from cupyflash.gpu import fwd as gpu_fwd
    d_v = d if d_v is None else d_v
    base = cp.random.standard_normal(64 * 2 * d + offset).astype(dtype)
    q = base[offset:].reshape(1, 64, 2, d)          # offset > 0: not 16-byte aligned
    if layout == "bhsd":
        q = cp.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    k = cp.random.standard_normal((1, 64, 2, d)).astype(dtype)
    v = cp.random.standard_normal((1, 64, 2, d_v)).astype(dtype)
    out = cp.empty((1, 64, 2, d_v), dtype)
    lse = cp.empty((1, 2, 64), cp.float32)
    scale = 1 / math.sqrt(d) if scale is None else scale
    return gpu_fwd.forward(q, k, v, out, lse, Options(scale=scale, **opts))


@pytest.mark.parametrize("case,expect", [
    (dict(dtype=np.float16, d=64), "fwd90_f16_d64"),
    (dict(dtype=np.float16, d=128, window_left=10, window_right=0), "fwd90_f16_d128"),
    (dict(dtype=np.float16, d=256, softcap=10.0), "fwd90_f16_d256"),
    (dict(dtype=np.float16, d=128, layout="bhsd"), "fwd90_f16_d128"),
    (dict(dtype=np.float16, d=96), "fwd_f16_d96"),                  # head dim not covered
    (dict(dtype=np.float16, d=128, d_v=64), "fwd_f16_d128"),         # d != d_v
    (dict(dtype=np.float32, d=128),                                   # float32: the flag
     "fwd90_f32x3_d128" if TUNING.sm90_float32_auto else "fwd_f32x3_d128"),
    (dict(dtype=np.float16, d=64, offset=1), "fwd_f16_d64"),        # q not 16-byte aligned
    (dict(dtype=np.float16, d=64, scale=-0.5), "fwd_f16_d64"),      # scale <= 0, no softcap
], ids=["d64", "d128_window", "d256_softcap", "bhsd", "d96", "dv_differs", "fp32",
        "misaligned", "negative_scale"])
def test_planner_picks_sm90_where_covered(case, expect):
    name = _auto_name(**case)
    assert name.startswith(expect), name


def test_forcing_sm90_on_an_uncovered_call_is_an_error():
    from cupyflash.gpu import fwd as gpu_fwd
    q = cp.random.standard_normal((1, 16, 1, 96)).astype(cp.float16)
    with pytest.raises(ValueError, match="Hopper kernel cannot run this call.*head dims 96"):
        gpu_fwd.forward(q, q, q, cp.empty_like(q), cp.empty((1, 1, 16), cp.float32),
                     Options(scale=0.1), kernel="sm90")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "split"])
def test_streams_and_repeated_launches(causal):
    """The work-tile counter, and the split tail's counters, are per stream and left zeroed by
    each launch: many launches on two streams at once, each checked against the portable kernel
    (non-causal at s = 1100, 48 work tiles of 9 key tiles run as 96 pieces: the split tail's
    workspace is per stream too)."""
    def check(out, ref, lse, ref_lse):
        assert float(cp.abs(out.astype(cp.float32) - ref.astype(cp.float32)).max()) < 1e-2
        assert float(cp.abs(lse - ref_lse).max()) < 1e-3
    names = launches_on_two_streams(cp.float16, 8, "auto", check, causal=causal,
                                    s=700 if causal else 1100)
    assert all(n.endswith("_split") != causal for n in names), names


# ---------------------------------------------------------------------------------------------
# The split tail (SPLIT variants: plan_fwd_sm90.sm90_split). The work tiles of the grid's last partial
# wave run as pieces along the keys; each tile's last piece to finish merges the others'
# partial O, m, l. Under kernel="sm90" the planner splits where its model gains (most cases
# here); a forced SPLIT variant always splits (into at least two pieces per tile of two or more
# key tiles; with a whole number of waves, the last full one), a forced plain one never.
# ---------------------------------------------------------------------------------------------
#: (b, s_q, s_k, h, h_k): one work tile over many key tiles (13-16 pieces; hd 128 on 176-key
#: tiles); GQA with a ragged key tail (the last piece masks it); more than a wave of tiles (a tail of
#: 24 tiles after two full waves at hd 128); one key tile (every piece a whole tile); single
#: query rows; s_q > s_k
SPLIT_CASES = {
    "one_tile": (1, 100, 9000, 1, 1),
    "gqa_ragged": (2, 333, 1777, 3, 1),
    "past_a_wave": (3, 1024, 700, 12, 4),
    "one_key_tile": (1, 257, 63, 2, 2),
    "single_rows": (4, 1, 3001, 8, 2),
    "sq_gt_sk": (1, 1500, 390, 4, 2),
}


def _plain(dtype, d, split, bn=None):
    v = plan_fwd_sm90.sm90_variant("f16_t" if dtype == "float16" else "bf16_t", d, False, False,
                           split=split)
    return v if bn is None else v.replace(bn=bn)


@pytest.mark.parametrize("case", list(SPLIT_CASES))
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_tail(rng, dtype, d, case):
    b, s_q, s_k, h, h_k = SPLIT_CASES[case]
    plan = plan_fwd_sm90.plan_forward_sm90(dtype, b, s_q, s_k, h, h_k, d, d, scale=0.1)
    assert sm90(rng, dtype, b, s_q, s_k, h, h_k, d) == plan.variant.name
    for split in (True, False):
        name = run_case(rng, dtype, b, s_q, s_k, h, h_k, d, kernel=_plain(dtype, d, split))
        assert name.endswith("_split") == split, name


@pytest.mark.parametrize("ramp", [6.0, 40.0])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_split_tail_rising_scores(rng, d, ramp):
    """Pieces over later keys see larger scores (key j scaled by 1 + ramp·j / s_k): the merge
    rescales each piece's partial by exp2((m_piece − m)·scale·log2 e), by more than 2^8 at
    ramp 40."""
    name = run_case(rng, "bfloat16", 1, 200, 3000, 2, 1, d, key_ramp=ramp,
                    kernel=_plain("bfloat16", d, True))
    assert name.endswith("_split"), name


@pytest.mark.parametrize("layout,pad", [("bhsd", 0), ("padded", 8)])
@pytest.mark.parametrize("bn", [128, 176])
def test_split_tail_wide_tiles_and_views(rng, bn, layout, pad):
    name = run_case(rng, "bfloat16", 2, 300, 2500, 4, 2, 128, layout=layout, pad=pad,
                    kernel=_plain("bfloat16", 128, True, bn))
    assert name == f"fwd90_bf16_d128_128x{bn}s2_split", name



#: The max-free softmax (MAXFREE: the loop's softmax against the running max of the tiles
#: before, exact where a lane's row sum of P over a tile exceeds 256; hd 128 × 128 keys), forced
#: on awkward shapes (the planner takes it from SM90_MAXFREE_MIN_KEYS keys a row): one key, ragged key
#: tails (the first key tile, right to left, is the one with masks and keeps the exact
#: softmax), s_q != s_k both ways, GQA, both dtypes, a bhsd view; the split tail's pieces.
MAXFREE_WHOLE = [(1, 1), (1, 239), (113, 203), (257, 63), (640, 2048), (1023, 1024)]
MAXFREE_SPLIT = [(640, 2048), (300, 2500)]
MAXFREE_CASES = [(*c, False) for c in MAXFREE_WHOLE] + [(*c, True) for c in MAXFREE_SPLIT]


@pytest.mark.parametrize("s_q,s_k,split", MAXFREE_CASES,
                         ids=[f"{a}x{b}" + ("-split" if sp else "") for a, b, sp in MAXFREE_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_maxfree(rng, dtype, s_q, s_k, split):
    var = _plain(dtype, 128, split).replace(maxfree=True)
    layout = "bhsd" if s_q == 113 else "bshd"
    name = run_case(rng, dtype, 2, s_q, s_k, 4, 2, 128, kernel=var, layout=layout)
    assert name == var.name, name


@pytest.mark.parametrize("ramp", [-6.0, -40.0, 6.0], ids=["down6", "down40", "up6"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_maxfree_rising_scores(rng, dtype, ramp):
    """Scores that rise in the kernel's key order (key 0 last: ramp < 0) take the exact path
    mid-row: each time the stale max falls 2^8 behind (6: about 1.3 in base 2 per key tile), or
    at once, after the max-free P overflowed (40); rising against it (6), never."""
    var = _plain(dtype, 128, False).replace(maxfree=True)
    name = run_case(rng, dtype, 1, 257, 3000, 2, 1, 128, key_ramp=ramp, kernel=var)
    assert name == var.name, name


def test_maxfree_is_planned():
    """kernel="auto" takes MAXFREE for dense hd 128 calls (on 128-key tiles) from
    SM90_MAXFREE_MIN_KEYS keys a row (the split twin too, which these two-tile calls take), and
    not otherwise."""
    from cupyflash.gpu import fwd as gpu_fwd
    lo = plan_fwd_sm90.SM90_MAXFREE_MIN_KEYS
    for s_k, causal, maxfree in [(lo, False, True), (4096, False, True), (lo - 1, False, False),
                                 (4096, True, False), (8192, False, True)]:
        q = cp.random.standard_normal((1, 128, 2, 128)).astype(np.float16)
        k, v = (cp.random.standard_normal((1, s_k, 2, 128)).astype(np.float16) for _ in range(2))
        out, lse = cp.empty_like(q), cp.empty((1, 2, 128), cp.float32)
        name = gpu_fwd.forward(q, k, v, out, lse, Options(scale=1 / math.sqrt(128),
                                                       window_right=0 if causal else -1))
        assert name.startswith("fwd90_f16_d128_128x"), name
        assert ("_maxfree" in name) == maxfree, (s_k, causal, name)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_out_base_not_16_byte_aligned(dtype, d):
    """out whose base is 4- but not 16-byte aligned. A variant that stages O for a TMA store
    (o_smem: hd 64, hd 128 with 128-key tiles) has no other epilogue: the call goes to the
    portable kernel. One that stores O itself (hd 256) runs with 4-byte stores instead of
    16-byte ones, bit for bit the same out and lse. Either way out and lse are near the
    portable kernel's, and exactly out's elements are written (201 rows: a ragged last tile,
    whose rows past s_q no path may write)."""
    import ml_dtypes
    from cupyflash.gpu import fwd as gpu_fwd, fwd_sm90
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else cp.float16
    b, s, h = 2, 201, 2
    q, k, v = (cp.random.standard_normal((b, s, h, d), dtype=cp.float32).astype(dt) for _ in range(3))
    opts = Options(scale=1 / math.sqrt(d), window_right=0)
    buf = cp.full(b * s * h * d + 2 + 8, cp.nan, cp.float32).astype(dt)
    outs = [buf[8:8 + b * s * h * d].reshape(b, s, h, d),      # 16-byte aligned
            buf[2:2 + b * s * h * d].reshape(b, s, h, d)]      # 4-byte aligned only
    results = []
    for out in outs:
        buf.fill(cp.nan)
        lse = cp.full((b, h, s), cp.nan, cp.float32)
        name = gpu_fwd.forward(q, k, v, out, lse, opts, kernel="sm90")
        results.append((name, out.copy(), lse, int(cp.isnan(buf.astype(cp.float32)).sum())))
    assert outs[0].data.ptr % 16 == 0 and outs[1].data.ptr % 16 == 4
    (name16, o16, lse16, nan16), (name4, o4, lse4, nan4) = results
    staged = fwd_sm90.variant_by_name(name16).o_smem
    assert staged == (d != 256)
    assert name16.startswith("fwd90_") and name4.startswith("fwd90_") == (not staged)
    assert nan16 == nan4 == buf.size - b * s * h * d           # exactly out's elements written
    if not staged:   # the same kernel, its two store widths
        assert cp.array_equal(o16.view(cp.uint16), o4.view(cp.uint16)) and cp.array_equal(lse16, lse4)
    ref, ref_lse = cp.empty_like(o16), cp.empty_like(lse16)
    gpu_fwd.forward(q, k, v, ref, ref_lse, opts, kernel="portable")
    for o, l in ((o16, lse16), (o4, lse4)):
        assert float(cp.abs(o.astype(cp.float32) - ref.astype(cp.float32)).max()) < 2e-2
        assert float(cp.abs(l - ref_lse).max()) < 1e-3
