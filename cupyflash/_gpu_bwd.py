"""GPU backward: planner (pure Python, testable without a GPU) and launcher.

Three kernels in kernels_cu/bwd.cu, launched in order on the current stream:

1. ``flash_bwd_pre<E>``: D = rowsum(dO ∘ O) [b, h, s_q] float32; zeroes the float32 dQ
   accumulator [b, h, s_q, d] (atomic mode).
2. ``flash_bwd<E, D, BM, NW, WD, NBUF, WINDOW, SCORE_MOD>``: one block per (key tile of
   BN = 16·NW/WD keys, kv head, batch); dK, dV in registers over every query head of the group
   and every query tile that sees the key tile (GQA sums in a fixed order, no atomics);
   dQ += dS K into the accumulator with red.global.add.f32, or, when ``opts.deterministic``,
   stored into the key tile's own slab of a [num_n_blocks, b, h, s_q, d] float32 buffer.
3. ``flash_bwd_dq<E>``: dq = dtype(accumulator); deterministic mode sums the slabs of the key
   tiles each row can see, in ascending order.

Extra device memory: D (4·b·h·s_q bytes) and the accumulator (4·b·h·s_q·d bytes), times
num_n_blocks = ceil(s_k / BN) in deterministic mode (see docs/backward.md).

``backward(dout, q, k, v, out, lse, dq, dk, dv, opts) -> str`` is the launcher the API calls.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import numpy as np

from . import _plan

ELEMS = _plan.ELEMS
HEAD_DIM_BUCKETS = _plan.HEAD_DIM_BUCKETS
_ELEM_SIZE = {"f16_t": 2, "bf16_t": 2, "f32x3_t": 4, "tf32_t": 4}

# (BM, NW, WD, NBUF) per (shared-memory class, element size) and head-dim bucket.
# BN = 16·NW/WD keys per block. Each warp holds dK and dV for 16 keys x D/WD columns in
# registers (D/WD floats per lane) plus Sᵀ and dPᵀ (BM/2 floats each); WD = 2 above 128 keeps
# that under the 255-register limit. Chosen from the ptxas reports (tests/test_compile_bwd.py).
_TILES = {
    ("big", 2): {32: (64, 8, 1, 2), 64: (64, 8, 1, 2), 96: (64, 8, 1, 2), 128: (32, 8, 1, 2),
                 160: (64, 8, 2, 2), 192: (32, 8, 2, 2), 224: (64, 8, 2, 1), 256: (32, 8, 2, 2)},
    ("small", 2): {32: (64, 8, 1, 2), 64: (64, 8, 1, 1), 96: (64, 8, 1, 1), 128: (32, 8, 1, 1),
                   160: (64, 8, 2, 1), 192: (32, 8, 2, 1), 224: (64, 4, 2, 1), 256: (32, 4, 2, 1)},
    ("big", 4): {32: (32, 4, 1, 2), 64: (32, 4, 1, 2), 96: (32, 4, 2, 2), 128: (32, 4, 1, 1),
                 160: (32, 4, 2, 1), 192: (32, 4, 2, 1), 224: (16, 4, 2, 1), 256: (16, 4, 2, 1)},
    ("small", 4): {32: (32, 4, 1, 2), 64: (32, 4, 1, 1), 96: (32, 4, 2, 1), 128: (32, 4, 2, 1),
                   160: (32, 4, 2, 1), 192: (32, 4, 4, 1), 224: (16, 4, 2, 1), 256: (16, 4, 4, 1)},
}


class BwdVariant(NamedTuple):
    """One template instantiation of flash_bwd."""

    elem: str
    d: int
    bm: int
    nw: int
    wd: int
    nbuf: int
    window: bool
    score_mod: bool

    @property
    def bn(self) -> int:
        return 16 * self.nw // self.wd

    @property
    def name_expression(self) -> str:
        b = lambda x: "true" if x else "false"  # noqa: E731
        return (f"flash_bwd<{self.elem}, {self.d}, {self.bm}, {self.nw}, {self.wd}, "
                f"{self.nbuf}, {b(self.window)}, {b(self.score_mod)}>")

    @property
    def pre_expression(self) -> str:
        return f"flash_bwd_pre<{self.elem}>"

    @property
    def dq_expression(self) -> str:
        return f"flash_bwd_dq<{self.elem}>"

    @property
    def name(self) -> str:
        flags = ("_window" if self.window else "") + ("_mod" if self.score_mod else "")
        return (f"bwd_{self.elem[:-2]}_d{self.d}_{self.bm}x{self.bn}w{self.nw}"
                f"s{self.wd}b{self.nbuf}{flags}")

    @property
    def threads(self) -> int:
        return 32 * self.nw

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.elem, self.d, self.bm, self.bn, self.nbuf)


def smem_bytes(elem: str, d: int, bm: int, bn: int, nbuf: int) -> int:
    """flash_bwd's dynamic shared memory: K, V [BN, pitch], NBUF x (Q, dO [BM, pitch]),
    dSᵀ [BN, BM + pad], NBUF x (lse, D [BM] float32). Mirrors BwdPitch / DsPitch in bwd.cu."""
    es = _ELEM_SIZE[elem]
    pr = d + 8 if es == 2 else d + 4
    pds = bm + 8 if es == 2 else bm + 4
    return (2 * bn * pr + 2 * nbuf * bm * pr + bn * pds) * es + 2 * nbuf * bm * 4


def tiles(elem: str, d_bucket: int, smem_optin: int) -> Tuple[int, int, int, int]:
    return _TILES[(_plan.smem_class(smem_optin), _ELEM_SIZE[elem])][d_bucket]


def all_variants(smem_optin: int = 227 * 1024):
    """Every BwdVariant the planner can select on a device with this shared-memory limit."""
    out = []
    for elem in ELEMS:
        for dbk in HEAD_DIM_BUCKETS:
            bm, nw, wd, nbuf = tiles(elem, dbk, smem_optin)
            for window in (False, True):
                for mod in (False, True):
                    out.append(BwdVariant(elem, dbk, bm, nw, wd, nbuf, window, mod))
    return out


class BwdPlan(NamedTuple):
    variant: BwdVariant
    grid: Tuple[int, int, int]          # flash_bwd: (num_n_blocks, h_k, b)
    block: Tuple[int, int, int]
    smem: int
    pre_grid: Tuple[int, int, int]      # flash_bwd_pre: 8 rows per 256-thread block
    dq_grid: Tuple[int, int, int]       # flash_bwd_dq: grid-stride over b·h·s_q·d
    accum_elems: int                    # float32 elements of the dQ accumulator (all slabs)
    params: np.ndarray                  # 0-d PARAMS_DTYPE: sizes and scalars filled


def plan_backward(dtype_name: str, b: int, s_q: int, s_k: int, h: int, h_k: int, d: int,
                  d_v: int, *, scale: float, window_left: int = -1, window_right: int = -1,
                  bottom_right: bool = True, softcap: float = 0.0, has_alibi: bool = False,
                  allow_tf32: bool = False, deterministic: bool = False,
                  smem_optin: int = 227 * 1024, num_sms: int = 132,
                  variant: Optional[BwdVariant] = None) -> BwdPlan:
    """Choose the backward variant and launch shapes; fill the size/scalar fields of Params."""
    if h % h_k:
        raise ValueError(f"heads {h} is not a multiple of heads_k {h_k}")
    if min(b, s_q, s_k, h, h_k, d, d_v) < 1:
        raise ValueError("empty problem: the launcher handles zero sizes before planning")
    elem = _plan.elem_tag(dtype_name, allow_tf32)
    dbk = _plan.head_dim_bucket(d, d_v)
    window = window_left >= 0 or window_right >= 0
    score_mod = softcap > 0 or has_alibi
    if variant is None:
        bm, nw, wd, nbuf = tiles(elem, dbk, smem_optin)
        variant = BwdVariant(elem, dbk, bm, nw, wd, nbuf, window, score_mod)
    elif (variant.elem != elem or variant.d < max(d, d_v) or (window and not variant.window)
          or (score_mod and not variant.score_mod)):
        raise ValueError(f"kernel {variant.name} cannot compute this problem")
    if variant.smem_bytes > smem_optin:
        raise NotImplementedError(
            f"{variant.name} needs {variant.smem_bytes} bytes of shared memory; the device "
            f"allows {smem_optin}")
    num_n = -(-s_k // variant.bn)
    if h_k > 65535 or b > 65535:
        raise NotImplementedError(f"grid ({num_n}, {h_k}, {b}) exceeds CUDA's grid limits")
    rows = b * h * s_q
    unbounded = s_q + s_k
    prm = np.zeros((), _plan.PARAMS_DTYPE)
    prm["b"], prm["h"], prm["h_k"], prm["h_per_hk"] = b, h, h_k, h // h_k
    prm["s_q"], prm["s_k"], prm["d"], prm["d_v"] = s_q, s_k, d, d_v
    prm["window_left"] = window_left if window_left >= 0 else unbounded
    prm["window_right"] = window_right if window_right >= 0 else unbounded
    prm["diag_offset"] = s_k - s_q if bottom_right else 0
    prm["num_m_blocks"] = -(-s_q // variant.bm)
    prm["scale_log2"] = scale * _plan.LOG2E
    prm["scale"] = scale
    if softcap > 0:
        prm["softcap_pre"] = scale / softcap
        prm["softcap_post"] = softcap * _plan.LOG2E
    prm["num_n_blocks"] = num_n
    prm["bn"] = variant.bn
    prm["deterministic"] = int(bool(deterministic))
    prm["dq_accum_slab"] = rows * d
    accum = rows * d * (num_n if deterministic else 1)
    dq_blocks = max(1, min(-(-rows * d // 256), num_sms * 8))
    return BwdPlan(variant, (num_n, h_k, b), (variant.threads, 1, 1), variant.smem_bytes,
                   (-(-rows // 8), 1, 1), (dq_blocks, 1, 1), accum, prm)


def query_tiles(n_block: int, bn: int, bm: int, s_q: int, s_k: int, window_left: int,
                window_right: int, diag_offset: int, window: bool = True) -> range:
    """Query tiles flash_bwd visits for key tile ``n_block`` (mirror of the kernel's i_lo/i_hi):
    those holding a row i that keeps some key j of the tile, i + off − left <= j <= i + off + right.
    Window sides are Params values (unbounded = s_q + s_k)."""
    n0 = n_block * bn
    n_rows = min(bn, s_k - n0)
    i_lo, i_hi = 0, s_q - 1
    if window:
        i_lo = max(0, n0 - diag_offset - window_right)
        i_hi = min(s_q - 1, n0 + n_rows - 1 - diag_offset + window_left)
    if i_hi < i_lo:
        return range(0)
    return range(i_lo // bm, i_hi // bm + 1)


def key_tiles(i: int, bn: int, s_k: int, window_left: int, window_right: int,
              diag_offset: int) -> range:
    """Key tiles whose dQ slabs flash_bwd_dq sums for row i (mirror of the kernel): the tiles
    holding a key that row i keeps."""
    diag = i + diag_offset
    j_lo, j_hi = max(0, diag - window_left), min(s_k - 1, diag + window_right)
    if j_lo > j_hi:
        return range(0)
    return range(j_lo // bn, j_hi // bn + 1)


def flops(b: int, h: int, s_q: int, s_k: int, d: int, d_v: int, causal: bool = False) -> float:
    """Backward FLOPs by FlashAttention's count: 2.5 x the forward's."""
    return 2.5 * _plan.flops(b, h, s_q, s_k, d, d_v, causal)


# ------------------------------------------------------------------------------------------
# Compilation (one RawModule per main variant, holding the two helper kernels of its dtype)
# ------------------------------------------------------------------------------------------
def program(variants):
    """(source, options, name expressions) compiling ``variants`` and their helper kernels."""
    from . import _modules
    src, opts, names = _modules.program(variants, file="bwd.cu")
    helpers = []
    for v in variants:
        for n in (v.pre_expression, v.dq_expression):
            if n not in helpers:
                helpers.append(n)
    return src, opts, names + helpers


_functions = {}   # (device id, variant) -> (main, pre, dq) RawKernels


def get_functions(variant: BwdVariant, device_id: int):
    key = (device_id, variant)
    fns = _functions.get(key)
    if fns is None:
        import cupy
        src, opts, names = program([variant])
        mod = cupy.RawModule(code=src, options=opts, name_expressions=names)
        main = mod.get_function(variant.name_expression)
        if variant.smem_bytes > 48 * 1024:
            main.max_dynamic_shared_size_bytes = variant.smem_bytes
        fns = _functions[key] = (main, mod.get_function(variant.pre_expression),
                                 mod.get_function(variant.dq_expression))
    return fns


def precompile(variants, workers: int = 8):
    """Fill CuPy's disk cache for ``variants`` (same programs as get_functions) in processes."""
    from . import _modules
    return _modules.precompile(variants, workers, program_fn=program)


# ------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------
_NUM_SMS = {}   # device id -> multiprocessor count


def _elem_strides(a, what):
    """(batch, seq, head) strides in elements of a 4-D bshd array with a unit last stride."""
    from . import _gpu
    if a.ndim != 4:
        raise ValueError(f"{what}: expected a 4-D bshd array, got shape {a.shape}")
    return _gpu._elem_strides(a, what)[:3]


def backward(dout, q, k, v, out, lse, dq, dk, dv, opts, *, kernel=None) -> str:
    """dq, dk, dv [...] = gradients of attention(q, k, v) at dout; returns the variant's name.

    dout, out [b, s_q, h, d_v]; q [b, s_q, h, d]; k [b, s_k, h_k, d]; v [b, s_k, h_k, d_v]:
    CuPy bshd views of one dtype with a contiguous last dimension; lse float32 [b, h, s_q]
    contiguous (natural log, -inf for rows that see no key); dq, dk, dv preallocated with
    q, k, v's shapes and dtype (any strides). Current device and stream. ``kernel``: None (the
    planner: the Hopper main kernel, _gpu_bwd_sm90, on compute capability 9.0 where it covers
    the call, else the portable one), "portable", "sm90" (ValueError where it cannot run), or a
    BwdVariant to force (tuning, benchmarks). Raises NotImplementedError for bias / mask,
    head dims > 256, other dtypes, pre-sm_80 GPUs.
    """
    import cupy
    from . import _gpu

    if opts.bias is not None or opts.mask is not None:
        raise NotImplementedError("GPU backward: bias / mask are not supported yet")
    name = _gpu._DTYPE_NAMES.get(q.dtype)
    if name is None:
        raise NotImplementedError(f"GPU backward: dtype {q.dtype} (float16, bfloat16, float32)")
    for a, w in ((k, "k"), (v, "v"), (out, "out"), (dout, "dout"), (dq, "dq"), (dk, "dk"),
                 (dv, "dv")):
        if a.dtype != q.dtype:
            raise ValueError(f"{w} has dtype {a.dtype}, q has {q.dtype}")
    if lse.dtype != np.float32 or not lse.flags.c_contiguous:
        raise ValueError("lse must be a contiguous float32 array [b, h, s_q]")
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    d_v = v.shape[3]
    if b == 0 or h == 0:
        return "empty"
    if s_q == 0 or s_k == 0 or d == 0 or d_v == 0:   # no products: the gradients are zero
        for a in (dq, dk, dv):
            if a.size:
                a.fill(0)
        return "empty"
    dev_id = cupy.cuda.runtime.getDevice()
    cc, smem, _ = _gpu._info(dev_id)
    if cc < 80:
        raise NotImplementedError(
            f"GPU backward needs compute capability 8.0 or newer; device {dev_id} is sm_{cc}")
    num_sms = _NUM_SMS.get(dev_id)
    if num_sms is None:   # Device.attributes queries every attribute: once per device
        num_sms = _NUM_SMS[dev_id] = cupy.cuda.Device(dev_id).attributes["MultiProcessorCount"]
    plan = plan_backward(
        name, b, s_q, s_k, h, h_k, d, d_v, scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        has_alibi=opts.alibi_slopes is not None, allow_tf32=bool(opts.allow_tf32),
        deterministic=bool(opts.deterministic), smem_optin=smem, num_sms=num_sms,
        variant=kernel if isinstance(kernel, BwdVariant) else None)
    prm = plan.params.copy()
    strides = []
    for a, t in ((q, "q"), (k, "k"), (v, "v"), (out, "o"), (dout, "do"), (dq, "dq"), (dk, "dk"),
                 (dv, "dv")):
        sb, ss, sh = _elem_strides(a, t)
        prm[f"{t}_stride_b"], prm[f"{t}_stride_s"], prm[f"{t}_stride_h"] = sb, ss, sh
        if t in ("q", "k", "v", "do"):
            strides += [sb, ss, sh]
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, dout.data.ptr)
    prm["vec_ok"] = int(_plan.vec_ok(ptrs, strides, q.dtype.itemsize))
    alibi = opts.alibi_slopes
    if alibi is not None:
        if alibi.dtype != np.float32 or (alibi.shape[1] > 1 and alibi.strides[1] != 4):
            alibi = cupy.ascontiguousarray(alibi, dtype=np.float32)
        prm["alibi"] = alibi.data.ptr
        prm["alibi_stride_b"] = alibi.strides[0] // 4 if alibi.shape[0] > 1 else 0
    dsum = cupy.empty((b, h, s_q), np.float32)
    accum = cupy.empty(plan.accum_elems, np.float32)
    for n, a in (("q", q), ("k", k), ("v", v), ("o", out), ("lse", lse), ("dout", dout),
                 ("dq", dq), ("dk", dk), ("dv", dv), ("dsum", dsum), ("dq_accum", accum)):
        prm[n] = a.data.ptr
    if kernel is None or kernel == "sm90":   # the Hopper main kernel where it covers the call
        from . import _gpu_bwd_sm90 as h90
        why = h90.unsupported(
            name, d, d_v, scale=float(opts.scale), softcap=float(opts.softcap or 0.0),
            has_alibi=alibi is not None, deterministic=bool(opts.deterministic), cc=cc,
            smem_optin=smem, tensors=[(a.shape, _gpu._elem_strides(a, t))
                                      for a, t in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout"))])
        ran = None if why else h90.launch(
            h90.Sm90BwdVariant(plan.variant.elem, d, plan.variant.window), prm, plan.pre_grid,
            plan.dq_grid, q, k, v, dout, dev_id)
        if ran is not None:
            return ran
        if kernel == "sm90":
            raise ValueError(f"kernel='sm90': the Hopper backward cannot run this call: "
                             f"{why or 'a base address is not 16-byte aligned'}")
    main, pre, conv = get_functions(plan.variant, dev_id)
    rec = prm.reshape(1)[0]
    pre(plan.pre_grid, (256, 1, 1), (rec,))
    main(plan.grid, plan.block, (rec,), shared_mem=plan.smem)
    conv(plan.dq_grid, (256, 1, 1), (rec,))
    return plan.variant.name


__all__ = ["BwdVariant", "BwdPlan", "plan_backward", "all_variants", "backward", "tiles",
           "smem_bytes", "flops", "program", "precompile"]
