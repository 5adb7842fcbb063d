"""CPU tests of the backward planner (cupyflash.gpu.plan_bwd): no GPU needed."""
from __future__ import annotations


import numpy as np
import pytest

from cupyflash.gpu import params as gpu_params, plan_bwd, plan_fwd, variants as gpu_variants

SMEMS = (99 * 1024, 163 * 1024, 227 * 1024)


@pytest.mark.parametrize("smem", SMEMS)
def test_every_variant_fits_and_meets_the_kernel_static_asserts(smem):
    vs = plan_bwd.variants(smem)
    # float64 above D = 160 has no tile on the small class (99 KB): 3 buckets x 5 variants fewer
    missing = 3 * 5 if smem < gpu_variants.BIG_SMEM else 0
    # flash_bwd_2d: 16-bit types, buckets 32..128, 4 flag pairs, on both classes
    two_d = 2 * 4 * 4
    assert len(vs) == len(gpu_variants.ELEMS) * len(gpu_variants.HEAD_DIM_BUCKETS) * 5 - missing + two_d   # 4 flag pairs + GENERAL
    assert sum(1 for v in vs if v.wms) == two_d
    for v in vs:
        if v.wms:
            v.check_2d()
            assert v.smem_bytes <= smem and not v.general, v.name
            continue
        cg = 16 if v.elem in ("f16_t", "bf16_t") else 8   # column granularity (portable/bwd.cu CG)
        wmq = v.bm // 16
        assert v.smem_bytes <= smem, v.name
        assert v.nw % v.wd == 0 and v.bn % 16 == 0, v.name
        assert v.bm % 16 == 0 and v.nw % wmq == 0, v.name
        assert (v.d // v.wd) % cg == 0 and (v.d // (v.nw // wmq)) % cg == 0, v.name
        assert v.nbuf in (1, 2)


def test_smem_formula():
    # bf16, D=64, BM=64, BN=128, two buffers: K, V 128x72, 2x(Q, dO) 64x72, dSᵀ 128x72, lse/D
    assert plan_bwd.smem_bytes("bf16_t", 64, 64, 128, 2) == \
        (2 * 128 * 72 + 4 * 64 * 72 + 128 * 72) * 2 + 4 * 64 * 4
    assert plan_bwd.smem_bytes("f32x3_t", 64, 32, 64, 1) == \
        (2 * 64 * 68 + 2 * 32 * 68 + 64 * 36) * 4 + 2 * 32 * 4


def test_plan_fields_and_grid():
    pl = plan_bwd.plan_backward("bfloat16", 2, 100, 300, 8, 2, 64, 64, scale=0.125,
                                window_right=0, softcap=0.0)
    v = pl.variant
    assert v.elem == "bf16_t" and v.d == 64 and v.window and not v.score_mod
    assert pl.grid == (-(-300 // v.bn), 2, 2)
    prm = pl.params
    assert prm["window_left"] == 400 and prm["window_right"] == 0
    assert prm["diag_offset"] == 200 and prm["h_per_hk"] == 4
    assert prm["deterministic"] == 0 and prm["bn"] == v.bn
    assert prm["dq_accum_slab"] == 2 * 8 * 100 * 64 and pl.accum_elems == 2 * 8 * 100 * 64
    assert np.isclose(prm["scale"], 0.125) and np.isclose(prm["scale_log2"], 0.125 * gpu_params.LOG2E)
    assert pl.pre_grid == (-(-2 * 8 * 100 // 8), 1, 1)


def test_plan_deterministic_slabs_and_softcap():
    pl = plan_bwd.plan_backward("float32", 1, 50, 1000, 2, 2, 128, 128, scale=0.1,
                                softcap=5.0, deterministic=True, bottom_right=False)
    v = pl.variant
    assert v.elem == "f32x3_t" and v.score_mod and not v.window
    assert pl.params["deterministic"] == 1 and pl.params["diag_offset"] == 0
    assert pl.accum_elems == pl.grid[0] * 1 * 2 * 50 * 128
    assert pl.params["dq_slabs"] == pl.grid[0] == -(-1000 // v.bn)   # few blocks: a slab per key tile
    assert np.isclose(pl.params["softcap_pre"], 0.1 / 5.0)


@pytest.mark.parametrize("b,s,h_k,num_sms", [(1, 16384, 16, 132), (2, 8192, 16, 132),
                                             (16, 1024, 16, 132), (1, 100_000, 1, 108),
                                             (4, 4096, 2, 132)],
                         ids=["16k-h16", "8k-b2", "1k-b16", "100k-h1", "4k-b4-h2"])
def test_deterministic_dq_slabs_are_bounded(b, s, h_k, num_sms):
    """Deterministic mode keeps G = resident blocks / (h_k b) dQ slabs (not one per key tile,
    which at s = 16k, hd 128 is the size of the float32 score matrix), 1 <= G <= key tiles: one
    wave of blocks (the planner assumes 2 per SM; the launcher asks the driver)."""
    pl = plan_bwd.plan_backward("bfloat16", b, s, s, h_k, h_k, 128, 128, scale=0.1,
                                deterministic=True, num_sms=num_sms)
    num_n = -(-s // pl.variant.bn)
    g = pl.grid[0]
    assert pl.params["dq_slabs"] == g and pl.params["num_n_blocks"] == num_n
    assert g == max(1, min(num_n, 2 * num_sms // (h_k * b)))
    assert g * h_k * b <= max(h_k * b, 2 * num_sms)          # one wave
    assert pl.accum_elems == g * b * h_k * s * 128
    three = plan_bwd.with_dq_slabs(pl, 3 * num_sms)            # e.g. 3 blocks per SM measured
    assert three.grid == (max(1, min(num_n, 3 * num_sms // (h_k * b))), h_k, b)
    assert three.params["dq_slabs"] == three.grid[0] and pl.params["dq_slabs"] == g   # pl untouched
    assert three.accum_elems == three.grid[0] * b * h_k * s * 128
    atomic = plan_bwd.plan_backward("bfloat16", b, s, s, h_k, h_k, 128, 128, scale=0.1, num_sms=num_sms)
    assert atomic.grid[0] == num_n and atomic.params["dq_slabs"] == 0
    assert atomic.accum_elems == b * h_k * s * 128


def test_plan_tf32_alibi_and_errors():
    pl = plan_bwd.plan_backward("float32", 1, 5, 5, 1, 1, 200, 17, scale=1.0, has_alibi=True,
                                allow_tf32=True)
    assert pl.variant.elem == "tf32_t" and pl.variant.d == 224 and pl.variant.score_mod
    with pytest.raises(NotImplementedError):
        plan_bwd.plan_backward("float16", 1, 5, 5, 1, 1, 257, 64, scale=1.0)
    with pytest.raises(ValueError):
        plan_bwd.plan_backward("float16", 1, 5, 5, 3, 2, 64, 64, scale=1.0)
    small = plan_bwd.variants()[0].replace(elem="f16_t", d=32)
    with pytest.raises(ValueError):
        plan_bwd.plan_backward("float16", 1, 5, 5, 1, 1, 64, 64, scale=1.0, variant=small)


def test_flops_is_2_5x_forward():
    assert plan_bwd.flops(1, 2, 3, 4, 5, 6) == 2.5 * plan_fwd.flops(1, 2, 3, 4, 5, 6)
    assert plan_bwd.flops(1, 2, 8, 8, 5, 5, causal=True) == 2.5 * 2 * 2 * 8 * 8 * 10 / 2


@pytest.mark.parametrize("s_q,s_k", [(1, 239), (113, 203), (203, 113), (300, 100), (64, 64)])
@pytest.mark.parametrize("wl,wr,br", [(-1, -1, True), (-1, 0, True), (-1, 0, False),
                                      (32, 16, True), (0, 0, True), (5, 3, False), (50, -1, True)])
def test_tile_skipping_covers_every_kept_pair(s_q, s_k, wl, wr, br):
    """Every kept (i, j): key tile of j visits i's query tile; with a window, every visited query
    tile holds a kept pair."""
    bm, bn = 32, 64
    unb = s_q + s_k
    left, right = (wl if wl >= 0 else unb), (wr if wr >= 0 else unb)
    off = s_k - s_q if br else 0
    i = np.arange(s_q)[:, None]
    j = np.arange(s_k)[None, :]
    keep = (j >= i + off - left) & (j <= i + off + right)
    window = wl >= 0 or wr >= 0
    for nb in range(-(-s_k // bn)):
        visited = set(plan_bwd.query_tiles(nb, bn, bm, s_q, s_k, left, right, off, window))
        want = {ii // bm for ii, jj in zip(*np.nonzero(keep)) if jj // bn == nb}
        assert want <= visited
        if window:
            assert visited == want or not want and not visited


# ------------------------------------------------------------------------------------------
# GENERAL backward: dbias reduction plan, varlen plan
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,b,h_k,det,mode,slabs", [
    ((2, 4, 10, 20), 2, 2, False, 0, 1),                 # full: one owner lane per element
    ((1, 4, 10, 20), 2, 2, False, 2, 1),                 # over batch: atomics
    ((1, 4, 10, 20), 2, 2, True, 4, 2),                  # ... deterministic: a slab per batch entry
    ((1, 4, 10, 20), 1, 2, True, 0, 1),                  # batch 1: nothing to reduce across blocks
    ((2, 1, 1, 20), 2, 2, False, 3, 1),                  # key padding: rows summed in-warp + atomics
    ((2, 1, 1, 20), 2, 2, True, 9, 2),                   # ... deterministic: a slab per kv head
    ((2, 1, 1, 20), 2, 1, False, 1, 1),                  # MQA: the group loop sums the heads
    ((1, 1, 10, 20), 3, 2, True, 12, 6),
    ((2, 4, 10, 1), 2, 2, False, -1, 0),                 # constant along keys: exactly zero
])
def test_dbias_plan(shape, b, h_k, det, mode, slabs):
    pl = plan_bwd.dbias_plan(shape, b, h_k, det)
    assert (pl.mode, pl.slabs) == (mode, slabs)
    if mode >= 0:   # contiguous strides of the bias's own shape, 0 along its size-1 dims
        want = np.zeros(shape, np.float32).strides
        assert pl.strides == tuple(0 if n == 1 else s // 4 for n, s in zip(shape, want))


@pytest.mark.parametrize("shape,b,h,want", [
    ((2, 4, 10, 20), 2, 4, True),       # full shape: one writer per element
    ((1, 4, 10, 20), 1, 4, True),       # batch 1: nothing summed
    ((1, 4, 10, 20), 2, 4, False),      # summed over batch
    ((2, 1, 10, 20), 2, 4, False),      # summed over heads (MQA / GQA or not)
    ((2, 1, 10, 20), 2, 1, True),       # one head
    ((2, 4, 1, 20), 2, 4, False),       # rows summed (DBIAS_ROWS)
    ((2, 4, 10, 1), 2, 4, False),       # constant along keys: zero-filled
])
def test_dbias_single_writer(shape, b, h, want):
    """DBIAS_STORE (the Hopper backward stores instead of adding) only where no two (batch,
    head, query) share a dbias element."""
    assert plan_bwd.single_writer(shape, b, h) is want


@pytest.mark.parametrize("shape,b,h,want", [
    ((1, 4, 10, 20), 3, 4, 2 | 32),     # summed over batch: atomics, batch-fastest tiles
    ((1, 4, 10, 20), 1, 4, 16),         # batch 1: stores
    ((2, 4, 10, 20), 2, 4, 16),         # full shape: stores
    ((1, 1, 1, 20), 3, 4, 1 | 2),       # rows summed in the kernel: tiny dbias, no reorder
    ((2, 1, 10, 20), 2, 4, 2),          # summed over kv heads: atomics
])
def test_hopper_dbias_mode(shape, b, h, want):
    dplan = plan_bwd.dbias_plan(shape, b, 2, False)
    assert plan_bwd.hopper_dbias_mode(dplan, b, h) == want


@pytest.mark.parametrize("shape,b,det,bias_dt,op_dt,direct,want", [
    ((1, 4, 10, 20), 2, False, "float16", "float16", False, True),    # 16-bit, summed over batch
    ((2, 4, 10, 20), 2, False, "float16", "float16", False, True),    # 16-bit, one writer: no fp32 copy either
    ((1, 1, 10, 20), 3, True, "float16", "float16", False, True),     # deterministic: no slabs
    ((1, 4, 10, 20), 2, False, "float32", "float32", True, False),    # float32 dbias is its own accumulator
    ((1, 4, 10, 20), 2, True, "float32", "float32", False, True),     # ... unless deterministic slabs
    ((1, 4, 10, 20), 2, False, "float16", "float32", False, False),   # cast bias: kernel writes float32
    ((2, 1, 1, 20), 2, False, "float16", "float16", False, False),    # rows summed: small accumulator
    ((2, 4, 10, 1), 2, False, "float16", "float16", False, False),    # constant along keys: zeros
], ids=["over-batch", "one-writer", "det-11qk", "f32-direct", "f32-det", "cast", "rows", "keys1"])
def test_dbias_by_kernel(shape, b, det, bias_dt, op_dt, direct, want):
    dplan = plan_bwd.dbias_plan(shape, b, 2, det)
    assert plan_bwd.dbias_by_kernel(dplan, bias_dt, op_dt, direct) is want


@pytest.mark.parametrize("forced,det,hopper,want", [
    (None, False, True, True),     # the Hopper dbias kernel covers the call: faster than the accumulator
    (None, False, False, False),   # only the portable dbias kernel: the accumulator first
    (None, True, False, True),     # deterministic: no slabs
    (False, True, True, False),    # DBIAS_KERNEL forces the accumulator ...
    (True, False, False, True),    # ... or the kernel
], ids=["hopper", "portable", "deterministic", "forced-off", "forced-on"])
def test_use_dbias_kernel(forced, det, hopper, want):
    assert plan_bwd.use_dbias_kernel(forced, det, hopper) is want


@pytest.mark.parametrize("elem", [e for e in gpu_variants.ELEMS if e != "f64_t"])   # (float64: no dbias kernel)
@pytest.mark.parametrize("smem", [99 * 1024, 163 * 1024, 227 * 1024])
def test_dbias_variant_tiles(elem, smem):
    """The first flash_bwd_dbias tile of DBIAS_TILES that fits (two buffers: the device's limit;
    one: min(limit, DBIAS_SMEM_CAP)) for every bucket; 16-bit hd 128 on the H100 / H200 takes
    128 x 64 with two buffers (8 warps)."""
    def _tile(v):
        return (v.bm, v.bn, v.nbuf)

    def cap(nbuf):
        return smem if nbuf == 2 else min(smem, plan_bwd.DBIAS_SMEM_CAP)

    for d in gpu_variants.HEAD_DIM_BUCKETS:
        v = plan_bwd.dbias_variant(elem, d, smem)
        assert v.smem_bytes <= cap(v.nbuf) and v.bm % 16 == 0 and v.bn % 16 == 0
        earlier = plan_bwd.DBIAS_TILES[:plan_bwd.DBIAS_TILES.index((v.bm, v.bn, v.nbuf))]
        assert all(plan_bwd.DbiasVariant(elem, d, *t).smem_bytes > cap(t[2]) for t in earlier)
        pr = d + 8 if elem in ("f16_t", "bf16_t") else d + 4
        es = 2 if elem in ("f16_t", "bf16_t") else 4
        assert v.smem_bytes == v.nbuf * ((2 * v.bm + 2 * v.bn) * pr * es + 8 * v.bm)
    assert _tile(plan_bwd.dbias_variant("bf16_t", 128, 227 * 1024)) == (128, 64, 2)
    assert _tile(plan_bwd.dbias_variant("bf16_t", 128, 163 * 1024)) == (64, 64, 1)
    assert plan_bwd.dbias_variant("bf16_t", 128).threads == 256


def test_varlen_backward_plan():
    pl = plan_bwd.plan_backward_varlen("bfloat16", 4, 700, 900, 300, 400, 8, 2, 64, 64,
                                       scale=0.1, window_left=16, deterministic=True)
    v, prm = pl.variant, pl.params
    assert v.general and v.window and v.score_mod
    assert pl.grid == (-(-400 // v.bn), 2, 4)
    assert (prm["b"], prm["s_q"], prm["s_k"], prm["varlen_bottom_right"]) == (1, 700, 900, 1)
    assert prm["window_left"] == 16 and prm["window_right"] == 1600
    assert prm["num_n_blocks"] == pl.grid[0] == prm["dq_slabs"]   # 4 seqs x 2 kv heads: a slab per key tile
    assert pl.accum_elems == pl.grid[0] * 8 * 700 * 64
    many = plan_bwd.plan_backward_varlen("bfloat16", 2, 9000, 9000, 8192, 8192, 16, 16, 64, 64,
                                         scale=0.1, deterministic=True, num_sms=132)
    assert many.params["num_n_blocks"] == -(-8192 // many.variant.bn)
    assert many.grid == (8, 16, 2) and many.params["dq_slabs"] == 8   # 264 // 32
    assert many.accum_elems == 8 * 16 * 9000 * 64


def test_flash_bwd_2d_variant_names_and_template_args():
    v = plan_bwd.variant_2d("bf16_t", 128, 227 * 1024, True, False)
    assert v.template == "flash_bwd_2d" and v.bn == 128 and not v.pair
    assert v.name == "bwd_bf16_d128_64x128w8t242b2_window"
    assert v.name_expression == "flash_bwd_2d<bf16_t, 128, 64, 8, 2, 4, 2, 2, true, false>"
    p = v.replace(pair=True)
    assert p.name == "bwd_bf16_d128_64x128w8t242pb2_window"
    assert p.name_expression.endswith("true, false, true>")
    assert v.smem_bytes == plan_bwd.smem_bytes_2d(128, 64, 128, 2) == \
        (2 * 128 * 136 + 4 * 64 * 136 + 2 * 64 * 136) * 2 + 4 * 64 * 4
    with pytest.raises(ValueError, match="not a flash_bwd_2d tiling"):
        v.replace(wmq=8).check_2d()          # dQ warp tile of 8 rows
    with pytest.raises(ValueError, match="not a flash_bwd_2d tiling"):
        v.replace(elem="f32x3_t").check_2d()
    with pytest.raises(ValueError, match="cannot compute"):   # no GENERAL features
        plan_bwd.plan_backward("bfloat16", 1, 64, 64, 1, 1, 128, 128, scale=1.0, has_bias=True,
                               variant=v)
