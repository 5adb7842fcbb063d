"""Hopper (sm_90a) backward main kernel: coverage, variants, compilation and launch.

``flash_bwd_sm90<E, D, WINDOW, DQ_BULK>`` in kernels_cu/bwd_sm90.cu replaces the portable main
kernel (flash_bwd in bwd.cu) on compute capability 9.0 wherever it covers the call; the helper
kernel before it (D = rowsum(dO ∘ O) with the zeroed dQ accumulator) is the portable one, the
dQ conversion after it is flash_bwd_dq_sm90; all three are compiled into the same module. Coverage (``unsupported`` says why not):
float16 / bfloat16, d = d_v in {64, 128}, no softcap / ALiBi, scale > 0, atomic (not
deterministic) dQ, strides TMA accepts (16-byte multiples) for q, k, v and dout.

One block per (key tile of 128 keys, kv head, batch): a producer warpgroup loads K, V once and
the Q / dO tiles of 64 query rows per step through TMA; two consumer warpgroups of 64 keys each
keep dK, dV in registers; each step's dQ tile goes through shared memory into the float32
accumulator (one cp.reduce.async.bulk .add.f32 by a producer warp). The accumulator's rows are
chunk-swizzled (bwd_sm90.cu: dq_swizzle), so the dQ conversion is flash_bwd_dq_sm90.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from . import _plan

BN = 128             # keys per block
BM = 64              # query rows per step
THREADS = 384
HEAD_DIMS = (64, 128)
NBUF = 2             # Q / dO ring depth


class Sm90BwdVariant(NamedTuple):
    """One template instantiation of flash_bwd_sm90 (plus its dtype's helper kernels)."""

    elem: str
    d: int
    window: bool
    dq_bulk: bool = True   # dQ tile via shared memory + one bulk reduce-add (else red.global)

    file = "bwd_sm90.cu"
    arch_options = ("-arch=sm_90a",)
    bn = BN
    bm = BM
    threads = THREADS

    @property
    def name_expression(self) -> str:
        tf = {True: "true", False: "false"}
        return f"flash_bwd_sm90<{self.elem}, {self.d}, {tf[self.window]}, {tf[self.dq_bulk]}>"

    @property
    def pre_expression(self) -> str:
        return f"flash_bwd_pre<{self.elem}>"

    @property
    def dq_expression(self) -> str:
        return f"flash_bwd_dq_sm90<{self.elem}>"

    @property
    def name(self) -> str:
        return (f"bwd90_{self.elem[:-2]}_d{self.d}_{BM}x{BN}" + ("_window" if self.window else "")
                + ("" if self.dq_bulk else "_red"))

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.d)


def smem_bytes(d: int) -> int:
    """Mirrors sm90b::Layout in bwd_sm90.cu: K, V [128, d]; NBUF x (Q, dO [64, d]); two dSᵀ
    [128, 64] buffers (16-bit); the dQ tile [64, d] float32; NBUF x
    (lse, D [64] floats); the mbarriers; 1024 bytes of slack to align the swizzled panels."""
    return (2 * BN * d * 2 + 2 * NBUF * BM * d * 2 + 2 * BN * BM * 2 + BM * d * 4
            + NBUF * 2 * BM * 4 + 8 * (3 + 2 * NBUF) + 1024)


def variants():
    """Every Sm90BwdVariant (compiled by the harness for sm_90a)."""
    return [Sm90BwdVariant(e, d, w) for e in ("f16_t", "bf16_t") for d in HEAD_DIMS
            for w in (False, True)]


def unsupported(dtype_name: str, d: int, d_v: int, *, scale: float, softcap: float,
                has_alibi: bool, deterministic: bool, cc: int, smem_optin: int,
                tensors=()) -> Optional[str]:
    """Why the Hopper backward kernel cannot run this call (None when it can). ``tensors``:
    (shape, element strides) of q, k, v and dout. Base pointers are checked at launch."""
    if softcap > 0 or has_alibi:
        return "softcap / alibi_slopes (not in the Hopper backward yet)"
    if not scale > 0:
        return f"scale {scale} <= 0"
    if deterministic:
        return "deterministic=True (the Hopper backward adds dQ with atomics)"
    return _plan.sm90_common_unsupported(dtype_name, d, d_v, HEAD_DIMS, cc=cc,
                                         smem_need=smem_bytes(d), smem_optin=smem_optin,
                                         tensors=tensors)


def program(variants_):
    """(source, options, name expressions) of ``variants_`` and their helper kernels: the same
    builder as the portable backward's (bwd_sm90.cu includes bwd.cu)."""
    from . import _gpu_bwd
    return _gpu_bwd.program(variants_)


def launch(variant: Sm90BwdVariant, prm, pre_grid, dq_grid, q, k, v, dout, dev_id) -> Optional[str]:
    """Run pre, the Hopper main kernel and the dQ conversion with the Params record ``prm``
    (pointers, strides, sizes filled by _gpu_bwd.backward). Returns None, launching nothing,
    when a base address is not 16-byte aligned (the caller runs the portable kernels)."""
    from . import _gpu, _tma

    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, dout.data.ptr)
    if any(p_ % _plan.TMA_ALIGN for p_ in ptrs) or int(prm["dk"]) % 4 or int(prm["dv"]) % 4:
        return None
    dtype_name = _gpu._DTYPE_NAMES[q.dtype]
    for field, a, rows in (("tma_q", q, BM), ("tma_k", k, BN), ("tma_v", v, BN),
                           ("tma_do", dout, BM)):
        dims, byte_strides, box = _plan.tma_tensor(a.shape, _gpu._elem_strides(a, field), 2, rows)
        prm[field] = _tma.encode(dtype_name, a.data.ptr, dims, byte_strides, box)
    from . import _gpu_bwd
    main, pre, conv = _gpu_bwd.get_functions(variant, dev_id)
    b, _, h, _ = q.shape
    s_k, h_k = k.shape[1], k.shape[2]
    rec = prm.reshape(1)[0]
    pre(pre_grid, (256, 1, 1), (rec,))
    main((-(-s_k // BN), h_k, b), (THREADS, 1, 1), (rec,), shared_mem=variant.smem_bytes)
    conv(dq_grid, (256, 1, 1), (rec,))
    return variant.name


__all__ = ["Sm90BwdVariant", "variants", "unsupported", "smem_bytes", "program", "launch"]
