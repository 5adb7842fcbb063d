"""Ring (context-parallel) attention: each rank holds a shard of the sequence; the key/value
shards travel round the ring while every rank attends its queries to each in turn and merges
the partial results by log-sum-exp.

Forward, on rank r, for step t = 0 .. world-1 (the key/value shard of rank ``(r - t) % world``):
start sending the current K/V shard to rank r+1 (receiving the next from rank r-1), run the
step's attention calls (blocks.py: the exact global causal / window mask as one or two calls
with bottom-right aligned masks), merge each call's (out, lse) into float32 accumulators, then
wait for the next shard. Only ``cupyflash.attention`` / ``cupyflash.attention_backward`` compute.

Backward (the standard ring backward): every call is ``attention_backward`` on the pair with
the FINAL out and lse of the forward, which gives that pair's exact share of dq, dk and dv. dq is
summed in place; dk and dv are summed into float32 accumulators that travel round the ring with
their K/V shard, one step behind it, and arrive home after a full circle.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np

from .. import attention, attention_backward
from .blocks import band, plan_rank
from .sharding import check_scheme, segments
from .transport import InProcessTransport, NcclTransport, Shift, Transport, _device_of

__all__ = ["ring_attention", "ring_attention_backward", "ring_attention_vjp"]


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------

def _check_window(window, causal):
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: got {causal!r}; accepted: True or False")
    if window is None:
        return
    ok = isinstance(window, (tuple, list)) and len(window) == 2
    if ok:
        for side in window:
            if side is None:
                continue
            if (isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer))
                    or side < -1):
                ok = False
    if not ok:
        raise ValueError(f"window: got {window!r}; accepted: None or a pair (left, right) of ints "
                         ">= 0, -1 or None (unbounded)")


def _check_layout(layout):
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout: got {layout!r}; accepted: 'bshd' or 'bhsd'")


def _bshd(name, x, layout):
    if not hasattr(x, "ndim") or not hasattr(x, "shape"):
        raise TypeError(f"{name}: got {type(x).__name__}; accepted: a NumPy or CuPy array")
    if x.ndim != 4:
        raise ValueError(f"{name}: got shape {tuple(x.shape)}; accepted: 4-D "
                         f"({'batch, seqlen, heads, head_dim' if layout == 'bshd' else 'batch, heads, seqlen, head_dim'})")
    return x if layout == "bshd" else x.transpose(0, 2, 1, 3)


def _from_bshd(xp, x, layout):
    return x if layout == "bshd" else xp.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _xp(x):
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def _lengths(name, given, local, rank, world):
    if given is None:
        return [int(local)] * world
    try:
        lens = [int(n) for n in given]
    except TypeError:
        raise ValueError(f"{name}: got {given!r}; accepted: None or one shard length per rank") from None
    if len(lens) != world or any(n < 0 for n in lens):
        raise ValueError(f"{name}: got {list(given)}; accepted: {world} shard lengths >= 0 (one per rank)")
    if lens[rank] != local:
        raise ValueError(f"{name}: says rank {rank} holds {lens[rank]} positions but its shard has "
                         f"{local}")
    return lens


@functools.lru_cache(maxsize=256)
def _plan(rank, sq, sk, scheme, lo, hi):
    """The calls of every ring step of ``rank`` (a pure function of the lengths and the mask)."""
    shift = sum(sk) - sum(sq)  # bottom-right alignment of the whole sequences
    return plan_rank(rank, segments(sq, scheme, shift), segments(sk, scheme), lo, hi)


class _Setup:
    """Everything a rank's generator needs besides the arrays."""

    def __init__(self, rank, world, lq, lk, seqlens_q, seqlens_k, scheme, causal, window,
                 scale, softcap):
        check_scheme(scheme)
        _check_window(window, causal)
        self.rank, self.world = rank, world
        self.sq = _lengths("seqlens_q", seqlens_q, lq, rank, world)
        self.sk = _lengths("seqlens_k", seqlens_k, lk, rank, world)
        lo, hi = band(causal, window)
        self.plan = _plan(rank, tuple(self.sq), tuple(self.sk), scheme, lo, hi)
        self.options = {"scale": scale, "softcap": softcap}

    def single(self, lq, lk) -> bool:
        """One call covers everything: the plain attention call (world 1)."""
        if self.world != 1 or len(self.plan[0]) != 1:
            return False
        b = self.plan[0][0]
        return (b.q0, b.q1, b.k0, b.k1) == (0, lq, 0, lk)


def _is_nccl_comm(comm):
    return all(hasattr(comm, m) for m in ("rank_id", "size", "send", "recv"))


def _transport(comm):
    if isinstance(comm, (Transport, InProcessTransport)):
        return comm
    if isinstance(comm, (list, tuple)) and comm and all(_is_nccl_comm(c) for c in comm):
        return _nccl_group_transport(comm)
    if _is_nccl_comm(comm):
        return _nccl_transport(comm)
    raise TypeError(f"comm: got {type(comm).__name__}; accepted: a cupy.cuda.nccl.NcclCommunicator, "
                    "a list of them (every rank, driven by this process), or a "
                    "cupyflash.distributed transport (NcclTransport, InProcessTransport)")


_NCCL_TRANSPORTS = {}


def _nccl_transport(comm):
    """One NcclTransport (and one stream) per communicator."""
    entry = _NCCL_TRANSPORTS.get(id(comm))
    if entry is None or entry[0] is not comm:
        entry = (comm, NcclTransport(comm))
        _NCCL_TRANSPORTS[id(comm)] = entry
    return entry[1]


def _nccl_group_transport(comms):
    """One InProcessTransport over NCCL per list of communicators (keyed by their ids)."""
    key = tuple(id(c) for c in comms)
    entry = _NCCL_TRANSPORTS.get(key)
    if entry is None or any(a is not b for a, b in zip(entry[0], comms)):
        entry = (tuple(comms), InProcessTransport(comms=comms))
        _NCCL_TRANSPORTS[key] = entry
    return entry[1]


def _acc_dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


# ----------------------------------------------------------------------------------------------
# Merging partial (out, lse) pairs
# ----------------------------------------------------------------------------------------------

_MERGE_KERNELS = {}
_FUSED = {"enabled": True}


def _merge_kernel(cp, bits: bool):
    key = bits
    kern = _MERGE_KERNELS.get(key)
    if kern is None:
        load = "__uint_as_float(((unsigned int)o) << 16)" if bits else "(float)o"
        kern = cp.ElementwiseKernel(
            "float32 al, float32 l, float32 nl, S o", "float32 acc",
            "float c1 = 0.f, c2 = 0.f;\n"
            "if (!isinf(nl)) { c1 = expf(al - nl); c2 = expf(l - nl); }\n"
            f"acc = acc * c1 + {load} * c2;",
            "cupyflash_ring_merge" + ("_bf16" if bits else ""))
        _MERGE_KERNELS[key] = kern
    return kern


def _merge(xp, acc_o, acc_l, o, l):
    """acc <- log-sum-exp merge of (acc_o, acc_l) and (o, l), in place. acc_o [b, n, h, dv]
    float32/64, acc_l [b, h, n]; o [b, n, h, dv] any float dtype, l [b, h, n]. A row whose merged
    lse is -inf (nothing seen by either) stays out 0, lse -inf."""
    new = xp.logaddexp(acc_l, l.astype(acc_l.dtype, copy=False))
    if xp is not np and acc_o.dtype == np.float32 and _FUSED["enabled"]:
        try:
            bits = np.dtype(o.dtype).name == "bfloat16"
            src = o.view(xp.uint16) if bits else o
            col = lambda x: x.transpose(0, 2, 1)[..., None]  # noqa: E731  [b, n, h, 1] views
            _merge_kernel(xp, bits)(col(acc_l), col(l.astype(np.float32, copy=False)), col(new),
                                    src, acc_o)
            acc_l[...] = new
            return
        except Exception as err:  # noqa: BLE001  a CuPy without the needed kernel support
            _FUSED["enabled"] = False
            warnings.warn(f"ring merge kernel unavailable ({err!r}); merging with CuPy array "
                          "operations instead", RuntimeWarning)
    fin = new > -np.inf
    safe = xp.where(fin, new, 0)
    c1 = xp.where(fin, xp.exp(acc_l - safe), 0).transpose(0, 2, 1)[..., None]
    c2 = xp.where(fin, xp.exp(l - safe), 0).transpose(0, 2, 1)[..., None]
    acc_o *= c1
    acc_o += o.astype(acc_o.dtype) * c2
    acc_l[...] = new


class _Acc:
    """float32 (float64) accumulators of out [b, s, h, dv] and lse [b, h, s]; rows no call covers
    stay out 0, lse -inf."""

    def __init__(self, xp, b, s, h, dv, dtype):
        self.xp = xp
        self.o = xp.zeros((b, s, h, dv), dtype)
        self.lse = xp.full((b, h, s), -np.inf, dtype)
        self.spans = []

    def add(self, q0, q1, o, l):
        if all(q1 <= a or b <= q0 for a, b in self.spans):  # first result for these rows
            self.o[:, q0:q1] = o
            self.lse[:, :, q0:q1] = l
        else:
            _merge(self.xp, self.o[:, q0:q1], self.lse[:, :, q0:q1], o, l)
        self.spans.append((q0, q1))


# ----------------------------------------------------------------------------------------------
# The per-rank algorithms (generators: each ``yield Shift(...)`` is one exchange)
# ----------------------------------------------------------------------------------------------

def _forward_rank(setup: _Setup, q, k, v):
    """Rank ``setup.rank``'s forward on bshd q, k, v: returns (out [bshd], lse)."""
    xp = _xp(q)
    w, r = setup.world, setup.rank
    b, lq, h, _ = q.shape
    hk, d, dv = k.shape[2], k.shape[3], v.shape[3]
    if setup.single(lq, k.shape[1]):
        opts = setup.plan[0][0].attention_options()
        return attention(q, k, v, return_lse=True, **opts, **setup.options)
    acc = _Acc(xp, b, lq, h, dv, _acc_dtype(q.dtype))
    k_cur, v_cur = k, v
    for t in range(w):
        handle = None
        if t < w - 1:
            n = setup.sk[(r - t - 1) % w]
            handle = yield Shift((k_cur, v_cur), [((b, n, hk, d), k.dtype), ((b, n, hk, dv), v.dtype)])
        for blk in setup.plan[t]:
            o, l = attention(q[:, blk.q0:blk.q1], k_cur[:, blk.k0:blk.k1], v_cur[:, blk.k0:blk.k1],
                             return_lse=True, **blk.attention_options(), **setup.options)
            acc.add(blk.q0, blk.q1, o, l)
        if handle is not None:
            k_cur, v_cur = handle.wait()
    lse_dtype = np.float64 if np.dtype(q.dtype) == np.float64 else np.float32
    return acc.o.astype(q.dtype), acc.lse.astype(lse_dtype, copy=False)


def _backward_rank(setup: _Setup, dout, q, k, v, out, lse, deterministic):
    """Rank ``setup.rank``'s backward on bshd arrays: returns (dq, dk, dv) bshd."""
    xp = _xp(q)
    w, r = setup.world, setup.rank
    b, lq, h, d = q.shape
    hk, dv = k.shape[2], v.shape[3]
    opts = dict(setup.options, deterministic=deterministic)
    if setup.single(lq, k.shape[1]):
        return attention_backward(dout, q, k, v, out, lse, **setup.plan[0][0].attention_options(),
                                  **opts)
    f = _acc_dtype(q.dtype)
    dq = xp.zeros(q.shape, f)
    k_cur, v_cur = k, v
    acc_handle = None
    for t in range(w):
        kv_handle = None
        if t < w - 1:
            n = setup.sk[(r - t - 1) % w]
            kv_handle = yield Shift((k_cur, v_cur), [((b, n, hk, d), k.dtype), ((b, n, hk, dv), v.dtype)])
        dk_part = dv_part = None
        if setup.plan[t] or acc_handle is None:
            dk_part = xp.zeros((b, k_cur.shape[1], hk, d), f)
            dv_part = xp.zeros((b, k_cur.shape[1], hk, dv), f)
        for blk in setup.plan[t]:
            rows, cols = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
            gq, gk, gv = attention_backward(
                dout[:, rows], q[:, rows], k_cur[:, cols], v_cur[:, cols], out[:, rows],
                xp.ascontiguousarray(lse[:, :, rows]), **blk.attention_options(), **opts)
            dq[:, rows] += gq.astype(f)
            dk_part[:, cols] += gk.astype(f)
            dv_part[:, cols] += gv.astype(f)
        if acc_handle is None:
            dk_acc, dv_acc = dk_part, dv_part
        else:
            dk_acc, dv_acc = acc_handle.wait()
            if dk_part is not None:  # (a step without calls passes the accumulators on)
                dk_acc += dk_part
                dv_acc += dv_part
        if w > 1:
            n = setup.sk[(r - t - 1) % w]
            acc_handle = yield Shift((dk_acc, dv_acc), [((b, n, hk, d), f), ((b, n, hk, dv), f)])
        if kv_handle is not None:
            k_cur, v_cur = kv_handle.wait()
    if acc_handle is not None:
        dk_acc, dv_acc = acc_handle.wait()
    return dq.astype(q.dtype), dk_acc.astype(k.dtype), dv_acc.astype(v.dtype)


# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------

def _per_rank(name, x, world):
    if not isinstance(x, (list, tuple)) or len(x) != world:
        got = f"{len(x)} arrays" if isinstance(x, (list, tuple)) else type(x).__name__
        raise ValueError(f"{name}: got {got}; accepted with an InProcessTransport: a list of "
                         f"{world} arrays, one per simulated rank")
    return list(x)


def _devices(arrays):
    devs = [_device_of(a) for a in arrays]
    return None if all(dv is None for dv in devs) else devs


def ring_attention(q, k, v, comm, *, causal=False, window=None, scale=None, softcap=None,
                   layout="bshd", return_lse=False, scheme="contiguous", seqlens_q=None,
                   seqlens_k=None):
    """Attention of this rank's query shard to the whole (sharded) key/value sequence.

    Parameters
    ----------
    q, k, v : this rank's shards, (batch, seqlen, heads, head_dim) [layout="bshd"] or
        (batch, heads, seqlen, head_dim) [layout="bhsd"]; the sequence split across ranks as
        ``shard(x, rank, world, scheme=scheme)`` does. NumPy or CuPy arrays, any dtype
        ``cupyflash.attention`` takes. With an :class:`InProcessTransport`: lists, one array per
        simulated rank, and the results are lists.
    comm : a ``cupy.cuda.nccl.NcclCommunicator`` (one rank per process), a transport
        (:class:`NcclTransport`), or an :class:`InProcessTransport` (simulated ranks).
    causal, window, scale, softcap : as ``cupyflash.attention``, applied to GLOBAL positions:
        the mask is the one ``attention`` would apply to the whole sequences (bottom-right
        aligned when the total query and key lengths differ).
    layout : "bshd" | "bhsd".
    return_lse : also return lse (batch, heads, seqlen) float32 (float64 for float64 inputs),
        this rank's rows of the whole call's lse.
    scheme : "contiguous" | "zigzag": how the sequence is sharded (``shard``). zigzag balances
        causal work; it needs equal, even shard lengths.
    seqlens_q, seqlens_k : the shard length of every rank, rank order (NCCL only; the simulated
        transport sees them). None: every rank holds as many positions as this one. Uneven
        shards need scheme="contiguous".

    Returns
    -------
    out like this rank's q (head_dim_v), in q's dtype and layout; and lse when return_lse.
    A row that sees no key gives out 0 and lse -inf.
    """
    _check_layout(layout)
    t = _transport(comm)
    kw = dict(causal=causal, window=window, scale=scale, softcap=softcap, scheme=scheme)
    if isinstance(t, InProcessTransport):
        qs, ks, vs = (_per_rank(n, x, t.world) for n, x in (("q", q), ("k", k), ("v", v)))
        qb = [_bshd("q", x, layout) for x in qs]
        kb = [_bshd("k", x, layout) for x in ks]
        vb = [_bshd("v", x, layout) for x in vs]
        sq, sk = [x.shape[1] for x in qb], [x.shape[1] for x in kb]
        _same("seqlens_q", seqlens_q, sq)
        _same("seqlens_k", seqlens_k, sk)
        gens = [_forward_rank(_Setup(r, t.world, sq[r], sk[r], sq, sk, **kw), qb[r], kb[r], vb[r])
                for r in range(t.world)]
        res = t.run(gens, _devices(qb))
        outs = [_from_bshd(_xp(o), o, layout) for o, _ in res]
        return (outs, [l for _, l in res]) if return_lse else outs
    qb, kb, vb = _bshd("q", q, layout), _bshd("k", k, layout), _bshd("v", v, layout)
    setup = _Setup(t.rank, t.world, qb.shape[1], kb.shape[1], seqlens_q, seqlens_k, **kw)
    o, l = t.run(_forward_rank(setup, qb, kb, vb))
    o = _from_bshd(_xp(o), o, layout)
    return (o, l) if return_lse else o


def _same(name, given, actual):
    if given is not None and [int(n) for n in given] != list(actual):
        raise ValueError(f"{name}: got {list(given)} but the simulated ranks' shards have "
                         f"{list(actual)}; accepted: None or those lengths")


def ring_attention_backward(dout, q, k, v, out, lse, comm, *, causal=False, window=None,
                            scale=None, softcap=None, layout="bshd", scheme="contiguous",
                            seqlens_q=None, seqlens_k=None, deterministic=False):
    """Gradients (dq, dk, dv) of ``ring_attention`` for this rank's shards.

    dout, out : this rank's rows, shaped like its out; lse : its rows of the forward's lse
    (``ring_attention(..., return_lse=True)``). Other arguments: as the forward, same values.
    dk and dv are summed while their K/V shard goes round the ring and are this rank's own
    shard's gradients on return. With an InProcessTransport every argument is a list per rank
    and so are the results.
    """
    _check_layout(layout)
    t = _transport(comm)
    kw = dict(causal=causal, window=window, scale=scale, softcap=softcap, scheme=scheme)
    if isinstance(t, InProcessTransport):
        w = t.world
        lists = [_per_rank(n, x, w) for n, x in (("dout", dout), ("q", q), ("k", k), ("v", v),
                                                  ("out", out), ("lse", lse))]
        do_b, qb, kb, vb, ob = ([_bshd(n, x, layout) for x in xs]
                                for n, xs in zip(("dout", "q", "k", "v", "out"), lists[:5]))
        ls = lists[5]
        sq, sk = [x.shape[1] for x in qb], [x.shape[1] for x in kb]
        _same("seqlens_q", seqlens_q, sq)
        _same("seqlens_k", seqlens_k, sk)
        gens = [_backward_rank(_Setup(r, w, sq[r], sk[r], sq, sk, **kw), do_b[r], qb[r], kb[r],
                               vb[r], ob[r], ls[r], deterministic) for r in range(w)]
        res = t.run(gens, _devices(qb))
        return [tuple(_from_bshd(_xp(g), g, layout) for g in grads) for grads in res]
    qb, kb, vb = _bshd("q", q, layout), _bshd("k", k, layout), _bshd("v", v, layout)
    setup = _Setup(t.rank, t.world, qb.shape[1], kb.shape[1], seqlens_q, seqlens_k, **kw)
    grads = t.run(_backward_rank(setup, _bshd("dout", dout, layout), qb, kb, vb,
                                 _bshd("out", out, layout), lse, deterministic))
    return tuple(_from_bshd(_xp(g), g, layout) for g in grads)


def ring_attention_vjp(q, k, v, comm, **options):
    """Forward now, backward later: ``out, vjp = ring_attention_vjp(q, k, v, comm, **options)``;
    ``vjp(dout, deterministic=False)`` returns (dq, dk, dv) for this rank's shards (lists of
    per-rank tuples with an InProcessTransport). ``options``: ``ring_attention``'s keywords
    (``return_lse`` excepted)."""
    if "return_lse" in options:
        raise TypeError("return_lse: not an option of ring_attention_vjp; accepted: "
                        "ring_attention's other keywords")
    out, lse = ring_attention(q, k, v, comm, return_lse=True, **options)

    def vjp(dout, deterministic=False):
        return ring_attention_backward(dout, q, k, v, out, lse, comm, deterministic=deterministic,
                                       **options)

    return out, vjp
