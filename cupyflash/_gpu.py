"""GPU forward launcher: CuPy arrays in, flash_fwd launched on the current device and stream.

The launch path is kept lean for small calls: everything that depends only on the "shape
signature" (dtypes, shapes, strides, options, device) is planned once and cached (variant,
compiled function, grid, Params with sizes/scalars filled); a call then writes its pointers and
the alignment flag into that cached Params record (struct.pack_into, under a lock) and launches.
The public API keeps the ``_Launch`` of a repeated call itself (api._FAST) and calls
``_Launch.launch`` directly, skipping this module's signature key.
"""
from __future__ import annotations

import math
import struct
import threading

import cupy
import numpy as np

from . import _modules, _plan, _tma

try:  # ml_dtypes supplies bfloat16 for NumPy / CuPy
    import ml_dtypes
    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    _BF16 = None

_DTYPE_NAMES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32"}
if _BF16 is not None:
    _DTYPE_NAMES[_BF16] = "bfloat16"

_device_info = {}   # device id -> (compute capability int, smem opt-in bytes, SM count)
_launch_cache = {}  # shape signature -> _Launch
_LAUNCH_CACHE_MAX = 4096
_record_lock = threading.Lock()
_VARIANTS_BY_NAME = None


# Byte offsets inside the Params record (see _plan.PARAMS_DTYPE): the six pointers q, k, v, o,
# lse, alibi are its first six uint64 words; alibi_stride_b an int64, vec_ok an int32.
_F = _plan.PARAMS_DTYPE.fields
assert [_F[n][1] for n in ("q", "k", "v", "o", "lse", "alibi")] == [0, 8, 16, 24, 32, 40]
_PUT_PTRS = struct.Struct("<6Q").pack_into                  # q, k, v, o, lse, alibi
_PUT_I64 = struct.Struct("<q").pack_into
_PUT_I32 = struct.Struct("<i").pack_into
_ALIBI_STRIDE_AT = _F["alibi_stride_b"][1]
_VEC_OK_AT = _F["vec_ok"][1]

try:  # a raw host pointer as a kernel argument: the launch reads the Params bytes from there
    from cupy.cuda.function import CPointer as _CPointer
except ImportError:  # pragma: no cover - other CuPy versions: pass the numpy.void record
    _CPointer = None


class _Launch:
    """Everything one shape signature needs at launch time.

    ``arr`` is the 1-element Params array passed by value (sizes, scalars and strides filled at
    build time); ``mem`` a writable byte view of it and ``args`` the kernel's argument tuple: a
    CuPy ``CPointer`` to its bytes (or the numpy.void record). A call writes its pointers into
    ``arr`` and launches under _record_lock, so threads may share one entry (the driver copies
    the argument bytes at launch, the next call may rewrite them right after).
    """

    __slots__ = ("fn", "grid", "block", "smem", "arr", "mem", "args", "name", "strides_ok")

    def __init__(self, fn, plan, strides_ok):
        self.fn = getattr(fn, "kernel", fn)  # RawKernel -> its Function on the current device
        self.grid = plan.grid
        self.block = plan.block
        self.smem = plan.smem
        self.arr = plan.params.reshape(1)   # view of plan.params (kept alive here)
        self.mem = memoryview(self.arr.view(np.uint8))
        self.args = (_CPointer(self.arr.ctypes.data) if _CPointer is not None else self.arr[0],)
        self.name = plan.variant.name
        self.strides_ok = strides_ok

    def launch(self, qp, kp, vp, op, lp, alibi_ptr=0, alibi_stride_b=0) -> str:
        """Write this call's pointers (device addresses, ints) into Params and launch on the
        current stream: q [b, s_q, h, d], k / v [b, s_k, h_k, d(_v)], out [b, s_q, h, d_v],
        lse [b, h, s_q], alibi [b or 1, h] (0 when none). Returns the kernel's name."""
        with _record_lock:
            mem = self.mem
            _PUT_PTRS(mem, 0, qp, kp, vp, op, lp, alibi_ptr)
            if alibi_ptr:
                _PUT_I64(mem, _ALIBI_STRIDE_AT, alibi_stride_b)
            _PUT_I32(mem, _VEC_OK_AT, self.strides_ok and ((qp | kp | vp | op) & 15) == 0)
            self.fn(self.grid, self.block, self.args, shared_mem=self.smem)
        return self.name


_current_stream = cupy.cuda.get_current_stream
#: the Hopper forward's tensor maps, in the order of its pointers q, k, v, out
_SM90_FWD_TMA_FIELDS = ("tma_q", "tma_k", "tma_v", "tma_o")


def _sm90_fwd_maps(variant, q, k, v, out, elem_strides):
    """(dims, byte strides, box) of the Hopper forward's tensor maps: q (boxes of BM rows), k, v
    (BN rows) and, for a variant that stages O in shared memory, out (boxes of 64 rows, one
    consumer's)."""
    tensors = [(q, variant.bm), (k, variant.bn), (v, variant.bn)]
    if getattr(variant, "o_smem", False):
        tensors.append((out, _plan.SM90_O_BOX_ROWS))
    return tuple(_plan.tma_tensor(a.shape, st, a.dtype.itemsize, rows)
                 for (a, rows), st in zip(tensors, elem_strides))


def sm90_out_align(variant, dtype_name) -> int:
    """Bytes out's base must be aligned to on the Hopper forward: 16 where O goes out through a
    TMA store (o_smem: such kernels have no other epilogue) or as float32 quads, else 4 (16-bit
    pairs)."""
    return 16 if dtype_name == "float32" or getattr(variant, "o_smem", False) else 4


_sched = {}   # (device id, stream handle) -> the Hopper kernel's work-tile counter


def _sched_counter(dev_id, stream) -> int:
    """Address of the zeroed uint32[2] work-tile counter of the Hopper kernel for launches on this
    stream (one per stream: kernels running at once on two streams must not share one; each
    launch leaves it zeroed for the next)."""
    key = (dev_id, stream)
    buf = _sched.get(key)
    if buf is None:
        buf = _sched[key] = cupy.zeros(2, cupy.uint32)
        cupy.cuda.get_current_stream().synchronize()   # zeroed before any kernel reads it
    return buf.data.ptr


_split_bufs = {}   # (device id, stream handle) -> (workspace, counters) of the split tail


def _to_device(a):
    """A host array's copy on the current device (kept by its launch entry, which may launch on
    any stream: the copy is complete when this returns)."""
    d = cupy.asarray(a)
    cupy.cuda.get_current_stream().synchronize()
    return d


def _split_buffers(dev_id, stream, ws_bytes, counters):
    """(workspace, counters) addresses for a Hopper forward whose last partial wave is split
    (SPLIT variants): at least ``ws_bytes`` of workspace for the pieces' partial O, m, l and
    ``counters`` zeroed uint32 (pieces finished per tile and consumer; each launch leaves them
    zeroed). One pair per stream, grown on demand: a replaced buffer goes back to CuPy's pool,
    which hands it out again only in that stream's order, after the kernels that used it."""
    key = (dev_id, stream)
    ws, count = _split_bufs.get(key, (None, None))
    if ws is None or ws.nbytes < ws_bytes:
        ws = cupy.empty(ws_bytes, cupy.uint8)
    if count is None or count.size < counters:
        count = cupy.zeros(counters, cupy.uint32)
        cupy.cuda.get_current_stream().synchronize()   # zeroed before any kernel reads it
    _split_bufs[key] = (ws, count)
    return ws.data.ptr, count.data.ptr


class _Sm90Launch(_Launch):
    """The Hopper kernel's entry. Its TMA descriptors bake in the base addresses, so finished
    Params records (pointers, descriptors and the stream's tile counter written, then never
    changed: no lock needed) are kept per (pointers, stream). A base address the kernel cannot
    take (a view at an odd offset: q, k, v not 16-byte aligned for TMA; out not 16-byte aligned
    where O goes out through a TMA store or as float32 quads, else not 4-byte aligned) sends the
    call to the portable kernel, whose entry is compiled on first need. A plan that splits the
    last wave (Plan.split) keeps its pieces' table on the device and takes the stream's
    workspace and counters (_split_buffers) into the record."""

    __slots__ = ("dtype_name", "maps", "out_align", "records", "portable_plan",
                 "portable_strides_ok", "dev_id", "portable", "split", "split_table",
                 "split_sizes")

    def __init__(self, fn, plan, dtype_name, maps, portable_plan, portable_strides_ok, dev_id):
        super().__init__(fn, plan, True)
        self.dtype_name = dtype_name
        self.maps = maps                      # (dims, byte strides, box) of q, k, v (, out)
        self.out_align = sm90_out_align(plan.variant, dtype_name)
        self.records = {}                     # (q, k, v, out, lse pointers, stream) -> (args, record)
        self.portable_plan = portable_plan
        self.portable_strides_ok = portable_strides_ok
        self.dev_id = dev_id
        self.portable = None
        self.split = plan.split               # [work items, 4] int32 (host), or None
        self.split_table = self.split_sizes = None   # ... on the device (the first record)
        if plan.split is not None:
            first, pieces = int(plan.params["split_first"]), int(plan.params["split_pieces"])
            self.split_sizes = (_plan.sm90_split_ws_bytes(plan.variant, pieces),
                                (int(plan.split[-1, 0]) + 1 - first) * plan.variant.nc)

    def launch(self, qp, kp, vp, op, lp, alibi_ptr=0, alibi_stride_b=0) -> str:
        stream = _current_stream().ptr
        ptrs = (qp, kp, vp, op, lp, stream)
        if self.split_sizes is not None:      # this stream's workspace and counters
            ptrs += _split_buffers(self.dev_id, stream, *self.split_sizes)
        hit = self.records.get(ptrs)
        if hit is None:
            # TMA bases; output stores of 16-bit pairs (4 bytes) or float32 quads (16 bytes)
            if (qp | kp | vp) % _plan.TMA_ALIGN or op % self.out_align:
                if self.portable is None:
                    plan = self.portable_plan
                    self.portable = _Launch(_modules.get_function(plan.variant, self.dev_id), plan,
                                            self.portable_strides_ok)
                return self.portable.launch(qp, kp, vp, op, lp)
            arr = self.arr.copy()             # sizes, scalars, strides of this signature
            _PUT_PTRS(memoryview(arr.view(np.uint8)), 0, qp, kp, vp, op, lp, 0)
            # q, k, v and, for a kernel staging O (o_smem), out
            for field, ptr, (dims, byte_strides, box) in zip(_SM90_FWD_TMA_FIELDS, ptrs, self.maps):
                arr[field][0] = _tma.encode(self.dtype_name, ptr, dims, byte_strides, box)
            arr["sched"][0] = _sched_counter(self.dev_id, stream)
            if self.split_sizes is not None:
                if self.split_table is None:
                    self.split_table = _to_device(self.split)
                arr["split_table"][0] = self.split_table.data.ptr
                arr["split_ws"][0], arr["split_count"][0] = ptrs[6:]
            hit = ((_CPointer(arr.ctypes.data) if _CPointer is not None else arr[0],), arr)
            if len(self.records) >= 64:       # many different buffers: start over
                self.records.clear()
            self.records[ptrs] = hit
        self.fn(self.grid, self.block, hit[0], shared_mem=self.smem)
        return self.name


def _info(dev_id):
    info = _device_info.get(dev_id)
    if info is None:
        dev = cupy.cuda.Device(dev_id)
        cc = int(dev.compute_capability)
        smem = int(dev.attributes["MaxSharedMemoryPerBlockOptin"])
        info = _device_info[dev_id] = (cc, smem, int(dev.attributes["MultiProcessorCount"]))
    return info


def _variant_by_name(name, smem):
    for v in _plan.all_variants(smem):
        if v.name == name:
            return v
    raise ValueError(f"kernel={name!r}: no such forward variant (see _plan.all_variants())")


def _elem_strides(a, what):
    isz = a.dtype.itemsize
    st = a.strides
    if a.shape[-1] > 1 and st[-1] != isz:
        raise ValueError(f"{what}: the last dimension must be contiguous (strides {st})")
    if any(s % isz for s in st):
        raise ValueError(f"{what}: strides {st} are not multiples of the item size {isz}")
    return tuple(s // isz for s in st)


_SM90_VARIANTS = (_plan.Sm90Variant, _plan.Sm90F32Variant)


def _want_sm90(kernel) -> bool:
    return kernel in ("auto", "sm90") or isinstance(kernel, _SM90_VARIANTS) or (
        isinstance(kernel, str) and kernel.startswith("fwd90_"))


def _sm90_variant_by_name(name):
    for v in _plan.sm90_variants() + _plan.sm90_f32_variants():
        if v.name == name:
            return v
    raise ValueError(f"kernel={name!r}: no such Hopper variant (see _plan.sm90_variants() and "
                     "_plan.sm90_f32_variants())")


def _sm90_check(q, k, v, out, opts, dtype_name, dev_id, smem):
    """(element strides of q, k, v, out; why the Hopper forward cannot run this call, or None)."""
    elem_strides = [_elem_strides(a, t) for a, t in ((q, "q"), (k, "k"), (v, "v"), (out, "o"))]
    reason = _plan.sm90_unsupported(
        dtype_name, q.shape[3], v.shape[3], scale=float(opts.scale),
        softcap=float(opts.softcap or 0.0), has_alibi=opts.alibi_slopes is not None,
        cc=_info(dev_id)[0], smem_optin=smem,
        tensors=[(a.shape, st) for a, st in zip((q, k, v, out), elem_strides)])
    return elem_strides, reason


def _build(key, q, k, v, out, lse, opts, kernel, dev_id):
    name, smem = _check_launchable(q, k, v, out, lse, dev_id)
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    d_v = v.shape[3]
    has_alibi = opts.alibi_slopes is not None
    extra = ()
    elem_strides, sm90_reason = _sm90_check(q, k, v, out, opts, name, dev_id, smem)
    if kernel == "auto" and name == "float32" and not _plan.SM90_FLOAT32_AUTO:
        sm90_reason = "float32 runs the portable kernel under kernel='auto' (SM90_FLOAT32_AUTO)"
    if _want_sm90(kernel):
        if sm90_reason is not None and kernel != "auto":
            raise ValueError(f"kernel={kernel!r}: the Hopper kernel cannot run this call: "
                             f"{sm90_reason}")
    if isinstance(kernel, tuple) and len(kernel) == 2 and isinstance(kernel[0], _plan.Variant):
        kernel, extra = kernel                 # (Variant, extra NVRTC options): tuning only
    if isinstance(kernel, _plan.Variant):      # an explicit instantiation (tuning, benchmarks)
        forced = kernel
    elif kernel in ("auto", "portable") or _want_sm90(kernel):
        forced = None
    else:
        forced = _variant_by_name(kernel, smem)
    plan = _plan.plan_forward(
        name, b, s_q, s_k, h, h_k, d, d_v, scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        has_alibi=has_alibi, allow_tf32=bool(opts.allow_tf32), smem_optin=smem,
        variant=forced)
    strides = _write_strides(plan.params, elem_strides)
    strides_ok = _plan.vec_ok((), strides, q.dtype.itemsize)
    if _want_sm90(kernel) and sm90_reason is None:
        return _build_sm90(q, k, v, out, opts, kernel, dev_id, name, elem_strides, plan, strides_ok)
    fn = _modules.get_function(plan.variant, dev_id, extra)
    return _Launch(fn, plan, strides_ok)


def _write_strides(prm, elem_strides):
    """Batch / sequence / head strides of q, k, v, out into the Params record; returns them."""
    flat = []
    for t, (sb, ss, sh, _) in zip("qkvo", elem_strides):
        prm[f"{t}_stride_b"], prm[f"{t}_stride_s"], prm[f"{t}_stride_h"] = sb, ss, sh
        flat += [sb, ss, sh]
    return flat


def _build_sm90(q, k, v, out, opts, kernel, dev_id, dtype_name, elem_strides, portable_plan,
                portable_strides_ok):
    """The Hopper kernel's launch entry (the planner accepted the call); the portable plan is
    its fallback for base addresses TMA cannot take."""
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    forced = None
    if isinstance(kernel, _SM90_VARIANTS):
        forced = kernel
    elif isinstance(kernel, str) and kernel.startswith("fwd90_"):
        forced = _sm90_variant_by_name(kernel)
    plan = _plan.plan_forward_sm90(
        dtype_name, b, s_q, s_k, h, h_k, d, v.shape[3], scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        num_sms=_info(dev_id)[2], variant=forced, allow_tf32=bool(opts.allow_tf32))
    _write_strides(plan.params, elem_strides)
    maps = _sm90_fwd_maps(plan.variant, q, k, v, out, elem_strides)
    fn = _modules.get_function(plan.variant, dev_id)
    return _Sm90Launch(fn, plan, dtype_name, maps, portable_plan, portable_strides_ok, dev_id)


_get_device = cupy.cuda.runtime.getDevice


def _key(q, k, v, out, opts, kernel):
    """The shape signature of one launch (the device is the current one)."""
    alibi = opts.alibi_slopes
    return (q.dtype, q.shape, k.shape, v.shape, q.strides, k.strides, v.strides, out.strides,
            opts.scale, opts.window_left, opts.window_right, opts.bottom_right, opts.softcap,
            None if alibi is None else alibi.shape, opts.allow_tf32,
            opts.bias is not None or opts.mask is not None, kernel, _get_device())


def _empty(q, k, out, lse) -> bool:
    """True when there is nothing to launch: no output, or no keys (every row attends to
    nothing: out = 0, lse = -inf, written here)."""
    if q.size == 0 or out.size == 0:
        return True
    if k.shape[1] == 0:
        out.fill(0)
        lse.fill(-math.inf)
        return True
    return False


def forward(q, k, v, out, lse, opts, *, kernel="auto") -> str:
    """out[...] = attention(q, k, v), lse[...] = its log-sum-exp; returns the variant's name.

    q [b, s_q, h, d], k [b, s_k, h_k, d], v [b, s_k, h_k, d_v], out [b, s_q, h, d_v] CuPy arrays
    of one dtype with a contiguous last dimension; lse float32 [b, h, s_q] contiguous.
    ``kernel``: "auto" (the planner's choice: the Hopper kernel on compute capability 9.0 where
    it covers the call, else the portable one), "portable" (the planner's portable choice),
    "sm90" (the Hopper kernel; ValueError when it cannot run the call), a variant name from
    _plan.all_variants() / _plan.sm90_variants() / _plan.sm90_f32_variants(), or a
    _plan.Variant / _plan.Sm90Variant / _plan.Sm90F32Variant (any instantiation, for tuning).
    float32 takes the Hopper float32 kernel under "auto" where it covers the call
    (_plan.SM90_FLOAT32_AUTO). Runs on the current device and stream.
    A bias or mask goes to ``_forward_general`` (planned per call): the Hopper BIAS variant for a
    bias it covers, else the portable GENERAL variant.
    Raises NotImplementedError for head dims > 256, other dtypes, pre-sm_80 GPUs.
    """
    if opts.bias is not None or opts.mask is not None:
        return _forward_general(q, k, v, out, lse, opts, kernel)
    alibi = opts.alibi_slopes
    key = _key(q, k, v, out, opts, kernel)
    ent = _launch_cache.get(key)
    if ent is None:
        if _empty(q, k, out, lse):
            return "empty"
        ent = _build(key, q, k, v, out, lse, opts, kernel, key[-1])
        if len(_launch_cache) >= _LAUNCH_CACHE_MAX:  # e.g. varlen: one signature per length
            _launch_cache.clear()
        _launch_cache[key] = ent
    if alibi is None:
        return ent.launch(q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr)
    alibi, stride_b = alibi_operand(alibi)
    return ent.launch(q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr,
                      alibi.data.ptr, stride_b)


def cached_launch(q, k, v, out, opts):
    """The cached ``_Launch`` that ``forward(q, k, v, out, lse, opts)`` just used, or None.

    For the API's repeated-call cache: an entry whose launch needs nothing but the five pointers
    (no ALiBi slopes, nothing empty). Call on the device ``forward`` ran on.
    """
    if opts.alibi_slopes is not None:
        return None
    return _launch_cache.get(_key(q, k, v, out, opts, "auto"))


# ------------------------------------------------------------------------------------------
# GENERAL variant: bias / mask (dense) and varlen. Planned per call (no launch cache): these
# calls carry arrays whose pointers and strides change from call to call anyway.
# ------------------------------------------------------------------------------------------
def _check_launchable(q, k, v, out, lse, dev_id):
    """(dtype name, smem opt-in): the checks _build makes, for the GENERAL launchers."""
    cc, smem, _ = _info(dev_id)
    if cc < 80:
        raise NotImplementedError(
            f"GPU forward needs compute capability 8.0 or newer (mma.sync bf16/tf32); device "
            f"{dev_id} is sm_{cc}")
    name = _DTYPE_NAMES.get(q.dtype)
    if name is None:
        raise NotImplementedError(f"GPU forward: dtype {q.dtype} (float16, bfloat16, float32)")
    for a, w in ((k, "k"), (v, "v"), (out, "out")):
        if a.dtype != q.dtype:
            raise ValueError(f"{w} has dtype {a.dtype}, q has {q.dtype}")
    if lse.dtype != np.float32 or not lse.flags.c_contiguous:
        raise ValueError("lse must be a contiguous float32 array [b, h, s_q]")
    return name, smem


def _forced(kernel, smem):
    if isinstance(kernel, _plan.Variant):
        return kernel
    return None if kernel in ("auto", "portable") else _variant_by_name(kernel, smem)


def bias_operand(bias, dtype):
    """(array, bias_f32) the kernels read for a 4-D ``bias``: the bias itself when its dtype is q's
    (``dtype``) or float32, else one float32 copy of the un-broadcast bias (documented:
    docs/choices.md). Element strides must be whole: otherwise a contiguous copy."""
    if bias.dtype == dtype or bias.dtype == np.float32:
        b = bias
    else:
        b = bias.astype(np.float32)
    if any(st % b.itemsize for st in b.strides):
        b = cupy.ascontiguousarray(b)
    return b, int(b.dtype == np.float32)


def broadcast_strides(a):
    """Element strides of a 4-D array over (b, h, s_q, s_k), 0 along its size-1 dimensions."""
    return tuple(0 if n == 1 else st // a.itemsize for n, st in zip(a.shape, a.strides))


def bias_pair_ok(b, s_k) -> bool:
    """Columns (j, j + 1) of the bias operand ``b`` load as one pair: unit key stride, even s_k,
    every (row, even column) pair aligned."""
    st = broadcast_strides(b)
    return (st[3] == 1 and s_k % 2 == 0 and all(x % 2 == 0 for x in st[:3])
            and b.data.ptr % (2 * b.itemsize) == 0)


def set_bias_mask(prm, opts, dtype, operand=None):
    """Write the bias / mask pointers, strides, bias_f32 and bias_pair into Params ``prm``
    (its s_k already set); ``operand``: bias_operand(opts.bias, dtype) when already made.
    Returns the arrays that must stay alive until the launch is queued."""
    keep = []
    if opts.bias is not None:
        b, f32 = operand if operand is not None else bias_operand(opts.bias, dtype)
        prm["bias"], prm["bias_f32"] = b.data.ptr, f32
        for a, x in zip("bhqk", broadcast_strides(b)):
            prm[f"bias_stride_{a}"] = x
        prm["bias_pair"] = int(bias_pair_ok(b, int(prm["s_k"])))
        keep.append(b)
    if opts.mask is not None:
        m = opts.mask
        if m.dtype != np.bool_:
            raise ValueError(f"mask has dtype {m.dtype}, bool expected")
        prm["mask"] = m.data.ptr
        for a, st in zip("bhqk", broadcast_strides(m)):
            prm[f"mask_stride_{a}"] = st
        keep.append(m)
    return keep


def _set_common(prm, q, k, v, out, lse, opts, zero_batch_strides=False):
    """Strides, vec_ok, pointers and ALiBi slopes of the forward Params; returns arrays to keep."""
    strides = []
    for a, t in ((q, "q"), (k, "k"), (v, "v"), (out, "o")):
        sb, ss, sh, _ = _elem_strides(a, t)
        if zero_batch_strides:
            sb = 0
        prm[f"{t}_stride_b"], prm[f"{t}_stride_s"], prm[f"{t}_stride_h"] = sb, ss, sh
        strides += [sb, ss, sh]
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr)
    prm["vec_ok"] = int(_plan.vec_ok(ptrs, strides, q.dtype.itemsize))
    for n, a in (("q", q), ("k", k), ("v", v), ("o", out), ("lse", lse)):
        prm[n] = a.data.ptr
    return set_alibi(prm, opts.alibi_slopes)


def alibi_operand(alibi):
    """(array, batch stride) the kernels read for ALiBi slopes [b or 1, h]: float32 with a unit
    head stride (one small copy otherwise); the batch stride is 0 when the slopes broadcast."""
    if alibi.dtype != np.float32 or (alibi.shape[1] > 1 and alibi.strides[1] != 4):
        alibi = cupy.ascontiguousarray(alibi, dtype=np.float32)
    return alibi, (alibi.strides[0] // 4 if alibi.shape[0] > 1 else 0)


def set_alibi(prm, alibi):
    """ALiBi slopes (or None) into Params ``prm``; returns the arrays to keep alive."""
    if alibi is None:
        return []
    alibi, stride_b = alibi_operand(alibi)
    prm["alibi"], prm["alibi_stride_b"] = alibi.data.ptr, stride_b
    return [alibi]


def _launch(plan, prm, dev_id):
    fn = _modules.get_function(plan.variant, dev_id)
    fn(plan.grid, plan.block, (prm.reshape(1)[0],), shared_mem=plan.smem)
    return plan.variant.name


def _forward_general(q, k, v, out, lse, opts, kernel="auto") -> str:
    """forward() with a bias and / or a mask: the Hopper kernel's BIAS variant on compute
    capability 9.0 for a bias alone where it covers the call (head dims SM90_BIAS_HEAD_DIMS,
    pair loads: bias_pair_ok), else the GENERAL variant of the portable kernel."""
    if _empty(q, k, out, lse):
        return "empty"
    dev_id = _get_device()
    name, smem = _check_launchable(q, k, v, out, lse, dev_id)
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    operand = None   # bias_operand(opts.bias, q.dtype), once made
    if _want_sm90(kernel):
        elem_strides, reason = _sm90_check(q, k, v, out, opts, name, dev_id, smem)
        if reason is None and name == "float32":
            reason = "float32 with a bias or mask (not in the float32 Hopper kernel)"
        if reason is None and opts.mask is not None:
            reason = "a boolean mask (not in the Hopper kernel yet)"
        if reason is None and d not in _plan.SM90_BIAS_HEAD_DIMS:
            reason = f"head dim {d} with a bias (the Hopper kernel takes {_plan.SM90_BIAS_HEAD_DIMS})"
        if reason is None:
            operand = bias_operand(opts.bias, q.dtype)
            if not bias_pair_ok(operand[0], s_k):
                reason = "bias layout (needs a unit key stride, even s_k and even strides)"
            elif (out.data.ptr | q.data.ptr | k.data.ptr | v.data.ptr) % _plan.TMA_ALIGN:
                # (q, k, v for TMA; out: the bias variants stage O for a TMA store, o_smem)
                reason = "base addresses not 16-byte aligned"
        if reason is None:
            return _forward_bias_sm90(q, k, v, out, lse, opts, name, elem_strides, operand, dev_id)
        if kernel != "auto":
            raise ValueError(f"kernel={kernel!r}: the Hopper kernel cannot run this call: {reason}")
    plan = _plan.plan_forward(
        name, b, s_q, s_k, h, h_k, d, v.shape[3], scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        has_alibi=opts.alibi_slopes is not None, allow_tf32=bool(opts.allow_tf32),
        smem_optin=smem, variant=_forced(kernel, smem), has_bias=opts.bias is not None,
        has_mask=opts.mask is not None)
    prm = plan.params
    keep = _set_common(prm, q, k, v, out, lse, opts) + set_bias_mask(prm, opts, q.dtype, operand)
    name = _launch(plan, prm, dev_id)
    del keep   # (CuPy's pool reuses freed memory only in stream order: safe after the launch)
    return name


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse,
                   opts, *, kernel="auto") -> str:
    """Packed (varlen) forward in one launch: the Hopper kernel's VARLEN variant on compute
    capability 9.0 where it covers the call (``kernel="auto"`` or ``"sm90"``), else the GENERAL
    variant of the portable kernel (``kernel="portable"`` forces it).

    q [1, total_q, h, d], k [1, total_k, h_k, d], v [1, total_k, h_k, d_v], out [1, total_q, h,
    d_v]: CuPy bshd views of the packed tokens (contiguous last dimension); lse float32
    [h, total_q] contiguous; cu_seqlens_q / _k int32 [batch + 1] CuPy arrays (validated by the
    caller); max_seqlen_q / _k: the longest sequences (ints). Sequence z is q rows
    cu_seqlens_q[z]:cu_seqlens_q[z + 1] against k / v rows cu_seqlens_k[z]:cu_seqlens_k[z + 1];
    causal / window are aligned per sequence; ALiBi slopes (batch, h) are per sequence.
    A sequence without keys gives out = 0, lse = -inf. Returns the variant's name.
    """
    if kernel not in ("auto", "sm90", "portable"):
        raise ValueError(f"kernel={kernel!r}: accepted 'auto', 'sm90', 'portable'")
    total_q, total_k = q.shape[1], k.shape[1]
    nseq = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or nseq == 0 or q.shape[2] == 0 or max_seqlen_q == 0:
        return "empty"
    if total_k == 0:
        out.fill(0)
        lse.fill(-math.inf)
        return "empty"
    dev_id = _get_device()
    name, smem = _check_launchable(q, k, v, out, lse, dev_id)
    _, _, h, d = q.shape
    h_k = k.shape[2]
    cq = cupy.ascontiguousarray(cu_seqlens_q, dtype=np.int32)
    ck = cupy.ascontiguousarray(cu_seqlens_k, dtype=np.int32)
    if kernel != "portable":
        elem_strides, reason = _sm90_check(q, k, v, out, opts, name, dev_id, smem)
        if reason is None and (opts.bias is not None or opts.mask is not None):
            reason = "a bias or mask with varlen (the GENERAL kernel's)"
        if reason is None and name == "float32":
            reason = "float32 varlen (not in the float32 Hopper kernel)"
        if reason is None and (q.data.ptr | k.data.ptr | v.data.ptr) % _plan.TMA_ALIGN == 0 \
                and out.data.ptr % 4 == 0:
            return _forward_varlen_sm90(q, k, v, cq, ck, int(max_seqlen_q), int(max_seqlen_k),
                                        out, lse, opts, name, elem_strides, dev_id)
        if kernel == "sm90":
            raise ValueError(f"kernel='sm90': the Hopper kernel cannot run this call: "
                             f"{reason or 'base addresses not 16-byte aligned'}")
    plan = _plan.plan_forward_varlen(
        name, nseq, total_q, total_k, int(max_seqlen_q), int(max_seqlen_k), h, h_k, d,
        v.shape[3], scale=float(opts.scale), window_left=int(opts.window_left),
        window_right=int(opts.window_right), bottom_right=bool(opts.bottom_right),
        softcap=float(opts.softcap or 0.0), has_alibi=opts.alibi_slopes is not None,
        allow_tf32=bool(opts.allow_tf32), smem_optin=smem)
    prm = plan.params
    keep = _set_common(prm, q, k, v, out, lse, opts, zero_batch_strides=True)
    prm["cu_seqlens_q"], prm["cu_seqlens_k"] = cq.data.ptr, ck.data.ptr
    name = _launch(plan, prm, dev_id)
    del keep, cq, ck
    return name


def _forward_bias_sm90(q, k, v, out, lse, opts, dtype_name, elem_strides, operand, dev_id) -> str:
    """forward() with a bias on the Hopper kernel (planned per call, like the GENERAL path)."""
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    variant = _plan.sm90_variant(
        _plan.elem_tag(dtype_name, False), d, opts.window_left >= 0 or opts.window_right >= 0,
        bool(opts.softcap), s_q, bias=2 if operand[1] else 1)
    plan = _plan.plan_forward_sm90(
        dtype_name, b, s_q, s_k, h, h_k, d, v.shape[3], scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        num_sms=_info(dev_id)[2], variant=variant)
    prm = plan.params
    keep = _set_common(prm, q, k, v, out, lse, opts) + set_bias_mask(prm, opts, q.dtype, operand)
    return _launch_sm90(plan, prm, (q, k, v, out), elem_strides, dtype_name, dev_id, keep)


def _launch_sm90(plan, prm, qkvo, elem_strides, dtype_name, dev_id, keep) -> str:
    """Launch a Hopper plan planned per call: tensor maps of q, k, v and (O staged) out
    (_sm90_fwd_maps; the callers have checked their bases: 16-byte aligned), the stream's
    work-tile counter; ``keep``: arrays alive until the launch is queued."""
    for field, a, (dims, byte_strides, box) in zip(_SM90_FWD_TMA_FIELDS, qkvo,
                                                   _sm90_fwd_maps(plan.variant, *qkvo, elem_strides)):
        prm[field] = _tma.encode(dtype_name, a.data.ptr, dims, byte_strides, box)
    prm["sched"] = _sched_counter(dev_id, _current_stream().ptr)
    name = _launch(plan, prm, dev_id)
    del keep
    return name


def _forward_varlen_sm90(q, k, v, cq, ck, max_seqlen_q, max_seqlen_k, out, lse, opts, dtype_name,
                         elem_strides, dev_id) -> str:
    """forward_varlen on the Hopper kernel (planned per call, like the GENERAL path): TMA maps
    over the packed [1, total, heads, d] tensors, the stream's work-tile counter."""
    _, total_q, h, d = q.shape
    total_k, h_k = k.shape[1], k.shape[2]
    plan = _plan.plan_forward_varlen_sm90(
        dtype_name, cq.shape[0] - 1, total_q, total_k, max_seqlen_q, max_seqlen_k, h, h_k, d,
        v.shape[3], scale=float(opts.scale), window_left=int(opts.window_left),
        window_right=int(opts.window_right), bottom_right=bool(opts.bottom_right),
        softcap=float(opts.softcap or 0.0), num_sms=_info(dev_id)[2])
    prm = plan.params
    keep = _set_common(prm, q, k, v, out, lse, opts, zero_batch_strides=True)
    prm["cu_seqlens_q"], prm["cu_seqlens_k"] = cq.data.ptr, ck.data.ptr
    return _launch_sm90(plan, prm, (q, k, v, out), elem_strides, dtype_name, dev_id, keep + [cq, ck])
