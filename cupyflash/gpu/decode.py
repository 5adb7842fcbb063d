"""Split-KV decode launcher (kernels_cu/portable/decode.cu): CuPy arrays in, kvcache_check, kvcache_prep,
flash_decode and flash_decode_combine launched on the current device and stream.

``build`` plans one validated ``attention_with_kvcache`` call whose attention the decode kernel
covers (plan_decode.why_unsupported is None) into a ``Launch`` (gpu/decode_route.attend runs it,
or hands multi-head calls to the Hopper forward); ``prepare`` runs only the append / rotary kernel
(the gather path of cupyflash/kvcache.py); ``device_errors`` reads kvcache_check's bits;
``forward_few_rows`` is the plain ``attention`` call's split-KV route (gpu/fwd.py hook).
"""
from __future__ import annotations

import struct

import cupy
import numpy as np

from . import compile, device, plan_decode
from .variants import DTYPE_NAMES

_LOG2E = 1.4426950408889634


def _elem_strides(x, names):
    """{name: stride in elements} for the leading axes of ``x`` (``names`` in axis order)."""
    item = x.dtype.itemsize
    return {n: s // item for n, s in zip(names, x.strides)}


def aligned(*arrays) -> bool:
    """Every array's base address 16-byte aligned, last dimension contiguous and other strides
    multiples of 16 bytes (the decode kernel's 16-byte loads)."""
    for x in arrays:
        if x is None:
            continue
        if x.data.ptr % 16 or (x.ndim and x.shape[-1] > 1 and x.strides[-1] != x.dtype.itemsize):
            return False
        if any(s % 16 for s in x.strides[:-1]):
            return False
    return True


def covers(q, k_cache, cc) -> str | None:
    """None when the decode kernel takes this call, else why not."""
    name = DTYPE_NAMES.get(q.dtype)
    if name is None:
        return f"dtype {q.dtype}"
    return plan_decode.why_unsupported(name, q.shape[3], k_cache.shape[3], cc,
                                       aligned(q, k_cache))


def _fill(prm, *, q, k_cache, v_cache, cache_seqlens, seqlens_const, block_table, page_size,
          max_blocks, s_new, opts):
    """The sizes, strides and options of DecodeParams shared by every kernel of one call."""
    b, s_q, h, d = q.shape
    h_k = k_cache.shape[2]
    prm["b"], prm["s_q"], prm["h"], prm["h_k"], prm["g"], prm["d"] = b, s_q, h, h_k, h // h_k, d
    prm["s_new"] = s_new
    prm["k_cache"], prm["v_cache"] = k_cache.data.ptr, v_cache.data.ptr
    for t, x in (("k", k_cache), ("v", v_cache)):
        st = _elem_strides(x, ("blk", "s", "h"))
        for a in ("blk", "s", "h"):
            prm[f"{t}_stride_{a}"] = st[a]
    prm["page_size"] = page_size
    prm["num_blocks"] = k_cache.shape[0]
    prm["max_blocks"] = max_blocks
    prm["capacity"] = page_size * max_blocks
    prm["cache_seqlens"] = 0 if cache_seqlens is None else cache_seqlens.data.ptr
    prm["seqlens_const"] = seqlens_const
    if block_table is not None:
        prm["block_table"] = block_table.data.ptr
        prm["bt_stride_b"] = block_table.strides[0] // 4
    prm["window_left"], prm["window_right"] = int(opts.window_left), int(opts.window_right)
    prm["bottom_right"] = int(bool(opts.bottom_right))
    scale = float(opts.scale)
    prm["scale_log2"] = scale * _LOG2E
    if opts.softcap:
        prm["softcap_pre"] = scale / float(opts.softcap)
        prm["softcap_post"] = float(opts.softcap) * _LOG2E
    if opts.alibi_slopes is not None:
        prm["alibi"] = opts.alibi_slopes.data.ptr
        prm["alibi_stride_b"] = h if opts.alibi_slopes.shape[0] > 1 else 0


def _set_bsh(prm, prefix, x):
    st = _elem_strides(x, "bsh")
    for a in "bsh":
        prm[f"{prefix}_stride_{a}"] = st[a]


def device_errors(prm, fns) -> int:
    """kvcache_check over the call's lengths and block table; returns its error bits (reads one
    int32 back: synchronizes with the current stream)."""
    b = int(prm["b"][0])
    if b == 0:
        return 0
    err = cupy.zeros(1, np.int32)
    prm["err"] = err.data.ptr
    fns(((b + 127) // 128,), (128,), (prm[0],))
    return int(err.get()[0])


def _set_inputs(prm, q, k_new, v_new, rot):
    """q, the new rows and the rotary tables of one call (before kvcache_check: it checks the
    rotary positions too)."""
    prm["q"] = q.data.ptr
    _set_bsh(prm, "q", q)
    if rot is not None:
        cos, sin, interleaved, per_row = rot
        prm["q_in"] = q.data.ptr
        _set_bsh(prm, "qi", q)
        prm["rot_cos"], prm["rot_sin"] = cos.data.ptr, sin.data.ptr
        prm["rot_dim"] = 2 * cos.shape[1]
        prm["rot_interleaved"] = int(interleaved)
        prm["rot_q_per_row"] = int(per_row)
        prm["seqlen_ro"] = cos.shape[0]
    if k_new is not None:
        prm["k_new"], prm["v_new"] = k_new.data.ptr, v_new.data.ptr
        _set_bsh(prm, "kn", k_new)
        _set_bsh(prm, "vn", v_new)


def _prep(prm, prep_fn, q, k_new, rot):
    """kvcache_prep: new k / v rows into the cache (k rotated), q rotated into a contiguous copy
    (returned; q itself without rotary)."""
    b, s_q, h, d = q.shape
    s_new = 0 if k_new is None else k_new.shape[1]
    q_att = q
    if rot is not None:
        q_att = cupy.empty(q.shape, q.dtype)
        prm["q"] = q_att.data.ptr
        _set_bsh(prm, "q", q_att)
    rows = b * s_new * int(prm["h_k"][0]) + (b * s_q * h if rot is not None else 0)
    if rows:
        prep_fn(((rows + 3) // 4,), (128,), (prm[0],))
    return q_att


def prepare(q, k_cache, v_cache, k_new, v_new, *, cache_seqlens, seqlens_const, block_table,
            page_size, max_blocks, rot, opts, check_device):
    """Append (and rotary) only, for the gather path: returns (q to attend with, error bits or
    0). float16, bfloat16 and float32 caches; any strides."""
    dev_id = device.get_device()
    name = DTYPE_NAMES.get(q.dtype)
    elem = plan_decode.ELEM_OF.get(name)
    if elem not in plan_decode.PREP_ELEMS:
        raise NotImplementedError(f"attention_with_kvcache on the GPU: dtype {q.dtype} "
                                  "(float16, bfloat16, float32)")
    prep_fn, check_fn = compile.get_functions(plan_decode.PrepVariant(elem), dev_id)
    prm = plan_decode.new_params()
    _fill(prm, q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
          seqlens_const=seqlens_const, block_table=block_table, page_size=page_size,
          max_blocks=max_blocks, s_new=0 if k_new is None else k_new.shape[1], opts=opts)
    _set_inputs(prm, q, k_new, v_new, rot)
    if check_device:
        bits = device_errors(prm, check_fn)
        if bits:
            return q, bits
    return _prep(prm, prep_fn, q, k_new, rot), 0


_F = plan_decode.DECODE_PARAMS_DTYPE.fields
_PUT_U64 = struct.Struct("<Q").pack_into
_PUT_I32 = struct.Struct("<i").pack_into
_OFF = {n: _F[n][1] for n in plan_decode.DECODE_PARAMS_DTYPE.names}


class Launch:
    """Everything one shape signature of an attention_with_kvcache call needs at launch time:
    the plan, the compiled kernels and a DecodeParams template with sizes, strides and options
    filled. ``__call__`` copies the template, writes the call's pointers and launches
    (kvcache_check and its read-back when ``check``, kvcache_prep when there are new rows or
    rotary, flash_decode, flash_decode_combine when split)."""

    __slots__ = ("plan", "main", "combine", "prep", "check_fn", "template", "prep_rows", "rot",
                 "q_shape", "dtype", "ws_o", "ws_lse", "b", "name", "groups", "dev_id")

    def __init__(self, plan, fns, template, prep_rows, rot, q_shape, dtype):
        self.plan = plan
        self.main, self.combine, self.prep, self.check_fn = fns
        self.template = template
        self.prep_rows = prep_rows
        self.rot = rot
        self.q_shape = q_shape
        self.dtype = dtype
        b, s_q, h, _ = q_shape
        self.b = b
        self.ws_o = plan.num_splits * b * s_q * h * plan.variant.d if plan.num_splits > 1 else 0
        self.ws_lse = plan.num_splits * b * h * s_q if plan.num_splits > 1 else 0
        self.name = plan.variant.name
        # CTA groups whose splits a fused combine counts (kv heads x batch x row tiles)
        self.groups = int(template["h_k"][0]) * b * plan.num_m_tiles
        self.dev_id = device.get_device()

    def prepare(self, q, kc, vc, kn, vn, cs_ptr, seqlens_const, bt_ptr, cos_ptr, sin_ptr,
                alibi_ptr, check):
        """kvcache_check (when ``check``) and kvcache_prep on the current stream: (the call's
        DecodeParams record, its bytes, q to attend with, error bits; nonzero: nothing launched
        after the check)."""
        rec = self.template.copy()
        mem = memoryview(rec.view(np.uint8))
        put, off = _PUT_U64, _OFF
        put(mem, off["q"], q.data.ptr)
        put(mem, off["q_in"], q.data.ptr)
        put(mem, off["k_cache"], kc.data.ptr)
        put(mem, off["v_cache"], vc.data.ptr)
        put(mem, off["cache_seqlens"], cs_ptr)
        _PUT_I32(mem, off["seqlens_const"], seqlens_const)
        put(mem, off["block_table"], bt_ptr)
        put(mem, off["alibi"], alibi_ptr)
        if kn is not None:
            put(mem, off["k_new"], kn.data.ptr)
            put(mem, off["v_new"], vn.data.ptr)
        if self.rot:
            put(mem, off["rot_cos"], cos_ptr)
            put(mem, off["rot_sin"], sin_ptr)
        if check and self.b:
            err = cupy.zeros(1, np.int32)
            put(mem, off["err"], err.data.ptr)
            self.check_fn(((self.b + 127) // 128,), (128,), (rec[0],))
            bits = int(err.get()[0])
            if bits:
                return rec, mem, q, bits
        q_att = q
        if self.rot:
            q_att = cupy.empty(self.q_shape, self.dtype)
            put(mem, off["q"], q_att.data.ptr)
        if self.prep_rows:
            self.prep(((self.prep_rows + 3) // 4,), (128,), (rec[0],))
        return rec, mem, q_att, 0

    def __call__(self, q, kc, vc, kn, vn, out, lse, cs_ptr, seqlens_const, bt_ptr, cos_ptr,
                 sin_ptr, alibi_ptr, check) -> int:
        """Launch on the current stream; returns kvcache_check's error bits (0 when ``check``
        is off or all is well; nonzero: nothing launched after the check)."""
        rec, mem, q_att, bits = self.prepare(q, kc, vc, kn, vn, cs_ptr, seqlens_const, bt_ptr,
                                             cos_ptr, sin_ptr, alibi_ptr, check)
        if bits:
            return bits
        put, off = _PUT_U64, _OFF
        put(mem, off["o"], out.data.ptr)
        put(mem, off["lse"], lse.data.ptr)
        ws = None
        if self.ws_o:
            ws = cupy.empty(self.ws_o + self.ws_lse, np.float32)
            put(mem, off["o_part"], ws.data.ptr)
            put(mem, off["lse_part"], ws.data.ptr + 4 * self.ws_o)
        plan = self.plan
        if ws is not None and plan.fused_combine:
            put(mem, off["split_count"], split_counters(self.dev_id, self.groups))
        self.main(plan.grid, plan.block, (rec[0],), shared_mem=plan.smem)
        if ws is not None and not plan.fused_combine:
            rows = self.ws_lse // plan.num_splits
            self.combine(((rows + 3) // 4,), (128,), (rec[0],))
        del ws, q_att   # CuPy's pool hands the memory out again only in this stream's order
        return 0


_counters = {}   # (device id, stream) -> zeroed uint32 counters of the fused combine


def split_counters(dev_id, n) -> int:
    """Address of >= n zeroed uint32 split counters for launches on the current stream (one
    buffer per stream: kernels running at once on two streams must not share one; each launch
    leaves its counters zeroed). Grown on demand; a replaced buffer goes back to CuPy's pool,
    which hands it out again only in that stream's order."""
    key = (dev_id, cupy.cuda.get_current_stream().ptr)
    buf = _counters.get(key)
    if buf is None or buf.size < n:
        buf = _counters[key] = cupy.zeros(max(n, 1024), np.uint32)
        cupy.cuda.get_current_stream().synchronize()   # zeroed before any kernel reads it
    return buf.data.ptr


def _contiguous_strides(shape):
    b, s, h, d = shape
    return {"b": s * h * d, "s": h * d, "h": d}


def build(q, k_cache, v_cache, k_new, v_new, *, with_lengths, block_table, page_size,
          max_blocks, rot, opts, num_splits, max_keys) -> Launch:
    """The Launch of one call signature (shapes, strides, dtypes, options; pointers come with each
    call). ``with_lengths``: cache_seqlens comes as a device array (else seqlens_const);
    ``rot``: (cos, sin, interleaved, q per row) or None, the tables' shapes read here."""
    dev_id = device.get_device()
    cc, smem, sms = device.info(dev_id)
    b, s_q, h, d = q.shape
    h_k = k_cache.shape[2]
    plan = plan_decode.plan_decode(DTYPE_NAMES[q.dtype], b, s_q, h, h_k, d, max_keys,
                                   num_splits, sms, smem)
    fns = compile.get_functions(plan.variant, dev_id, plan_decode.build_options())
    prm = plan_decode.new_params()
    s_new = 0 if k_new is None else k_new.shape[1]
    _fill(prm, q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=None, seqlens_const=0,
          block_table=block_table, page_size=page_size, max_blocks=max_blocks, s_new=s_new,
          opts=opts)
    _set_inputs(prm, q, k_new, v_new, rot)
    prm["q"] = prm["k_cache"] = prm["v_cache"] = prm["block_table"] = prm["alibi"] = 0
    prm["k_new"] = prm["v_new"] = prm["q_in"] = prm["rot_cos"] = prm["rot_sin"] = 0
    if rot is not None:   # flash_decode reads the rotated contiguous copy
        for a, st in _contiguous_strides(q.shape).items():
            prm[f"q_stride_{a}"] = st
    prm["num_splits"], prm["num_m_tiles"] = plan.num_splits, plan.num_m_tiles
    prm["head_fastest"] = int(plan.head_fastest)
    for a, st in _contiguous_strides((b, s_q, h, d)).items():
        prm[f"o_stride_{a}"] = st
    prep_rows = b * s_new * h_k + (b * s_q * h if rot is not None else 0)
    return Launch(plan, fns, prm, prep_rows, rot is not None, q.shape, q.dtype)


def forward_few_rows(q, k, v, out, lse, opts):
    """The plain ``attention`` forward on the split-KV path when plan_decode.route_attention
    takes it (few packed rows, many keys): returns the variant's name, or None (not taken: the
    caller runs its own kernel). q [b, s_q, h, d], k / v [b, s_k, h_k, d], out [b, s_q, h, d]
    contiguous, lse float32 [b, h, s_q] contiguous; ``opts`` as the forward's."""
    if opts.bias is not None or opts.mask is not None or q.size == 0 or k.shape[1] == 0:
        return None
    name = DTYPE_NAMES.get(q.dtype)
    if name is None:
        return None
    dev_id = device.get_device()
    cc, smem, sms = device.info(dev_id)
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    if cc < 80 or not plan_decode.route_attention(name, b, s_q, s_k, h, h_k, d, v.shape[3],
                                                  False, sms, cc):
        return None
    if not (aligned(q, k, v) and out.flags.c_contiguous and lse.flags.c_contiguous):
        return None
    key = (q.shape, q.strides, k.shape, k.strides, v.strides, q.dtype, opts.scale,
           opts.window_left, opts.window_right, opts.bottom_right, opts.softcap,
           None if opts.alibi_slopes is None else opts.alibi_slopes.shape, dev_id,
           tuple(plan_decode.TUNING.values()))
    ent = _few_rows_cache.get(key)
    if ent is None:
        ent = build(q, k, v, None, None, with_lengths=False, block_table=None, page_size=s_k,
                    max_blocks=1, rot=None, opts=opts, num_splits=0, max_keys=s_k)
        if len(_few_rows_cache) > 1024:
            _few_rows_cache.clear()
        _few_rows_cache[key] = ent
    ent(q, k, v, None, None, out, lse, 0, s_k, 0, 0, 0,
        0 if opts.alibi_slopes is None else opts.alibi_slopes.data.ptr, False)
    return ent.name


_few_rows_cache = {}
device.when_limit_changes(_few_rows_cache.clear)


def workspace_bytes(plan, b, s_q, h) -> int:
    """Bytes of the split workspace (partial O and lse, float32) a plan allocates per call."""
    if plan.num_splits <= 1:
        return 0
    return 4 * plan.num_splits * b * s_q * h * (plan.variant.d + 1)


__all__ = ["build", "Launch", "prepare", "device_errors", "forward_few_rows", "covers", "aligned",
           "workspace_bytes"]
