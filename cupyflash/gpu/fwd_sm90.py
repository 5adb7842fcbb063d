"""Hopper forward kernels (flash_fwd_sm90, kernels_cu/hopper/fwd.cu; flash_fwd_sm90_f32,
kernels_cu/hopper/fwd_f32.cu): coverage check and launch (planning: plan_fwd_sm90.py).

``build`` makes the cached launch entry of a dense call (``_Sm90Launch``: its TMA descriptors
bake in the base addresses, so finished Params records are kept per pointers and stream; a base
the kernel cannot take falls back to the portable kernel's entry). ``forward_bias`` and
``forward_varlen`` plan and launch per call.
"""
from __future__ import annotations

import numpy as np

from . import compile, device, fwd_portable, operands, params, plan_fwd_sm90, tma
from .variants import elem_tag


#: the Hopper forward's tensor maps, in the order of its pointers q, k, v, out
_SM90_FWD_TMA_FIELDS = ("tma_q", "tma_k", "tma_v", "tma_o")


def _sm90_fwd_maps(variant, q, k, v, out, elem_strides):
    """(dims, byte strides, box) of the Hopper forward's tensor maps: q (boxes of BM rows), k, v
    (BN rows) and, for a variant that stages O in shared memory, out (boxes of 64 rows, one
    consumer's)."""
    tensors = [(q, variant.bm), (k, variant.bn), (v, variant.bn)]
    if getattr(variant, "o_smem", False):
        tensors.append((out, plan_fwd_sm90.SM90_O_BOX_ROWS))
    return tuple(tma.tma_tensor(a.shape, st, a.dtype.itemsize, rows)
                 for (a, rows), st in zip(tensors, elem_strides))


def sm90_out_align(variant, dtype_name) -> int:
    """Bytes out's base must be aligned to on the Hopper forward: 16 where O goes out through a
    TMA store (o_smem: such kernels have no other epilogue) or as float32 quads, else 4 (16-bit
    pairs)."""
    return 16 if dtype_name == "float32" or getattr(variant, "o_smem", False) else 4


class _Sm90Launch(fwd_portable.Launch):
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
        self.out_align = plan_fwd_sm90.sm90_out_align(plan.variant, dtype_name)
        self.records = {}                     # (q, k, v, out, lse pointers, stream) -> (args, record)
        self.portable_plan = portable_plan
        self.portable_strides_ok = portable_strides_ok
        self.dev_id = dev_id
        self.portable = None
        self.split = plan.split               # [work items, 4] int32 (host), or None
        self.split_table = self.split_sizes = None   # ... on the device (the first record)
        if plan.split is not None:
            first, pieces = int(plan.params["split_first"]), int(plan.params["split_pieces"])
            self.split_sizes = (plan_fwd_sm90.sm90_split_ws_bytes(plan.variant, pieces),
                                (int(plan.split[-1, 0]) + 1 - first) * plan.variant.nc)

    def launch(self, qp, kp, vp, op, lp, alibi_ptr=0, alibi_stride_b=0) -> str:
        stream = device.current_stream().ptr
        ptrs = (qp, kp, vp, op, lp, stream)
        if self.split_sizes is not None:      # this stream's workspace and counters
            ptrs += device.split_buffers(self.dev_id, stream, *self.split_sizes)
        hit = self.records.get(ptrs)
        if hit is None:
            # TMA bases; output stores of 16-bit pairs (4 bytes) or float32 quads (16 bytes)
            if (qp | kp | vp) % tma.TMA_ALIGN or op % self.out_align:
                if self.portable is None:
                    plan = self.portable_plan
                    self.portable = fwd_portable.Launch(compile.get_function(plan.variant, self.dev_id), plan,
                                            self.portable_strides_ok)
                return self.portable.launch(qp, kp, vp, op, lp)
            arr = self.arr.copy()             # sizes, scalars, strides of this signature
            fwd_portable.PUT_PTRS(memoryview(arr.view(np.uint8)), 0, qp, kp, vp, op, lp, 0)
            # q, k, v and, for a kernel staging O (o_smem), out
            for field, ptr, (dims, byte_strides, box) in zip(_SM90_FWD_TMA_FIELDS, ptrs, self.maps):
                arr[field][0] = tma.encode(self.dtype_name, ptr, dims, byte_strides, box)
            arr["sched"][0] = device.sched_counter(self.dev_id, stream)
            if self.split_sizes is not None:
                if self.split_table is None:
                    self.split_table = device.to_device(self.split)
                arr["split_table"][0] = self.split_table.data.ptr
                arr["split_ws"][0], arr["split_count"][0] = ptrs[6:]
            hit = ((fwd_portable.CPointer(arr.ctypes.data) if fwd_portable.CPointer is not None else arr[0],), arr)
            if len(self.records) >= 64:       # many different buffers: start over
                self.records.clear()
            self.records[ptrs] = hit
        self.fn(self.grid, self.block, hit[0], shared_mem=self.smem)
        return self.name

_SM90_VARIANTS = (plan_fwd_sm90.Sm90Variant, plan_fwd_sm90.Sm90F32Variant)


def want_sm90(kernel) -> bool:
    return kernel in ("auto", "sm90") or isinstance(kernel, _SM90_VARIANTS) or (
        isinstance(kernel, str) and kernel.startswith("fwd90_"))


def variant_by_name(name):
    for v in plan_fwd_sm90.variants() + plan_fwd_sm90.f32_variants():
        if v.name == name:
            return v
    raise ValueError(f"kernel={name!r}: no such Hopper variant (see plan_fwd_sm90.variants() and "
                     "plan_fwd_sm90.f32_variants())")


def check(q, k, v, out, opts, dtype_name, dev_id, smem):
    """(element strides of q, k, v, out; why the Hopper forward cannot run this call, or None)."""
    elem_strides = [params.elem_strides(a, t) for a, t in ((q, "q"), (k, "k"), (v, "v"), (out, "o"))]
    reason = plan_fwd_sm90.why_unsupported(
        dtype_name, q.shape[3], v.shape[3], scale=float(opts.scale),
        softcap=float(opts.softcap or 0.0), has_alibi=opts.alibi_slopes is not None,
        cc=device.info(dev_id)[0], smem_optin=smem,
        tensors=[(a.shape, st) for a, st in zip((q, k, v, out), elem_strides)])
    return elem_strides, reason


def build(q, k, v, out, opts, kernel, dev_id, dtype_name, elem_strides, portable_plan,
                portable_strides_ok):
    """The Hopper kernel's launch entry (the planner accepted the call); the portable plan is
    its fallback for base addresses TMA cannot take."""
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    forced = None
    if isinstance(kernel, _SM90_VARIANTS):
        forced = kernel
    elif isinstance(kernel, str) and kernel.startswith("fwd90_"):
        forced = variant_by_name(kernel)
    plan = plan_fwd_sm90.plan_forward_sm90(
        dtype_name, b, s_q, s_k, h, h_k, d, v.shape[3], scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        num_sms=device.info(dev_id)[2], variant=forced, allow_tf32=bool(opts.allow_tf32))
    params.write_strides(plan.params, elem_strides)
    maps = _sm90_fwd_maps(plan.variant, q, k, v, out, elem_strides)
    fn = compile.get_function(plan.variant, dev_id)
    return _Sm90Launch(fn, plan, dtype_name, maps, portable_plan, portable_strides_ok, dev_id)


def forward_bias(q, k, v, out, lse, opts, dtype_name, elem_strides, operand, dev_id) -> str:
    """forward() with a bias on the Hopper kernel (planned per call, like the GENERAL path)."""
    b, s_q, h, d = q.shape
    _, s_k, h_k, _ = k.shape
    variant = plan_fwd_sm90.sm90_variant(
        elem_tag(dtype_name, False), d, opts.window_left >= 0 or opts.window_right >= 0,
        bool(opts.softcap), s_q, bias=2 if operand[1] else 1)
    plan = plan_fwd_sm90.plan_forward_sm90(
        dtype_name, b, s_q, s_k, h, h_k, d, v.shape[3], scale=float(opts.scale),
        window_left=int(opts.window_left), window_right=int(opts.window_right),
        bottom_right=bool(opts.bottom_right), softcap=float(opts.softcap or 0.0),
        num_sms=device.info(dev_id)[2], variant=variant)
    prm = plan.params
    keep = operands.set_common(prm, q, k, v, out, lse, opts) + operands.set_bias_mask(prm, opts, q.dtype, operand)
    return _launch_sm90(plan, prm, (q, k, v, out), elem_strides, dtype_name, dev_id, keep)


def _launch_sm90(plan, prm, qkvo, elem_strides, dtype_name, dev_id, keep) -> str:
    """Launch a Hopper plan planned per call: tensor maps of q, k, v and (O staged) out
    (_sm90_fwd_maps; the callers have checked their bases: 16-byte aligned), the stream's
    work-tile counter; ``keep``: arrays alive until the launch is queued."""
    for field, a, (dims, byte_strides, box) in zip(_SM90_FWD_TMA_FIELDS, qkvo,
                                                   _sm90_fwd_maps(plan.variant, *qkvo, elem_strides)):
        prm[field] = tma.encode(dtype_name, a.data.ptr, dims, byte_strides, box)
    prm["sched"] = device.sched_counter(dev_id, device.current_stream().ptr)
    name = fwd_portable.launch_plan(plan, prm, dev_id)
    del keep
    return name


def forward_varlen(q, k, v, cq, ck, max_seqlen_q, max_seqlen_k, out, lse, opts, dtype_name,
                         elem_strides, dev_id) -> str:
    """forward_varlen on the Hopper kernel (planned per call, like the GENERAL path): TMA maps
    over the packed [1, total, heads, d] tensors, the stream's work-tile counter."""
    _, total_q, h, d = q.shape
    total_k, h_k = k.shape[1], k.shape[2]
    plan = plan_fwd_sm90.plan_forward_varlen_sm90(
        dtype_name, cq.shape[0] - 1, total_q, total_k, max_seqlen_q, max_seqlen_k, h, h_k, d,
        v.shape[3], scale=float(opts.scale), window_left=int(opts.window_left),
        window_right=int(opts.window_right), bottom_right=bool(opts.bottom_right),
        softcap=float(opts.softcap or 0.0), num_sms=device.info(dev_id)[2])
    prm = plan.params
    keep = operands.set_common(prm, q, k, v, out, lse, opts, zero_batch_strides=True)
    prm["cu_seqlens_q"], prm["cu_seqlens_k"] = cq.data.ptr, ck.data.ptr
    return _launch_sm90(plan, prm, (q, k, v, out), elem_strides, dtype_name, dev_id, keep + [cq, ck])
