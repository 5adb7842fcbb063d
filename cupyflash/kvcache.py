"""``attention_with_kvcache``: attention of a few query rows against a key/value cache (inference),
with FlashAttention's ``flash_attn_with_kvcache`` semantics (docs/kvcache.md).

Flow: validate (``check_kvcache``, a pure function of shapes, dtypes and host values) -> the
NumPy implementation (cupyflash/cpu_kvcache.py) for host arrays, or the GPU: the split-KV decode
kernels (gpu/decode.py; multi-head calls on the Hopper forward where gpu/decode_route.py routes
them) where they cover the call, else the gather path (append / rotary kernel,
the cache gathered per batch entry, ``attention_varlen``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import numpy as np

from . import _checks as ck
from . import _interop

__all__ = ["attention_with_kvcache", "check_kvcache", "KVDims", "set_device_checks"]

Array = Any
_INT32_MAX = 2**31 - 1

#: Device-held cache_seqlens / block_table values are checked before launch by one small kernel
#: whose result is read back (a synchronization with the stream). set_device_checks(False) skips
#: the read-back: the kernels still never read or write outside the cache (lengths clamped to
#: the capacity, bad block indices read page 0 and new rows past the capacity are dropped), but a
#: bad value then gives wrong rows instead of an error.
_DEVICE_CHECKS = [True]


def set_device_checks(enabled: bool) -> bool:
    """Turn the pre-launch check of device-held lengths and block indices on or off (default
    on); returns the previous setting."""
    ck.check_flag("enabled", enabled)
    prev = _DEVICE_CHECKS[0]
    _DEVICE_CHECKS[0] = bool(enabled)
    return prev


@dataclass(frozen=True)
class KVDims:
    """Sizes of one attention_with_kvcache call."""

    batch: int
    seqlen_q: int
    heads: int
    heads_k: int
    head_dim: int
    seqlen_new: int        # rows of k / v appended (0: none)
    paged: bool
    page_size: int         # keys per page (contiguous cache: its seqlen)
    num_blocks: int        # pages in the cache (contiguous: batch)
    max_blocks: int        # block_table columns (contiguous: 1)
    rotary_dim: int        # 0: no rotary
    seqlen_ro: int

    @property
    def capacity(self) -> int:
        """Keys one batch entry can hold."""
        return self.page_size * self.max_blocks


def _shape(x):
    return tuple(int(n) for n in x.shape)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                  rotary_cos=None, rotary_sin=None, num_splits=0) -> KVDims:
    """Shapes and dtypes of one call (any objects with .shape / .dtype; cache_seqlens may be an
    int). Raises ValueError / TypeError naming the argument (docs/semantics.md §8)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            want = ("(batch, seqlen_q, heads, head_dim)" if name == "q" else
                    "(batch, seqlen_cache, heads_k, head_dim) or (num_blocks, page_size, heads_k, "
                    "head_dim) with block_table")
            ck.fail(ValueError, name, f"{x.ndim}-D array of shape {_shape(x)}", f"a 4-D array {want}")
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if (k is None) != (v is None):
        ck.fail(TypeError, "v" if k is not None else "k", "None while the other is given",
                "both k and v (new rows to append) or neither")
    if k is not None:
        named.update(k=k, v=v)
    ck.check_same_dtype(named)
    b, s_q, h, d = _shape(q)
    if _shape(v_cache) != _shape(k_cache):
        ck.fail(ValueError, "v_cache", f"shape {_shape(v_cache)} while k_cache has {_shape(k_cache)}",
                "the same shape for k_cache and v_cache")
    nb, page, h_k, dk = _shape(k_cache)
    if dk != d:
        ck.fail(ValueError, "k_cache", f"head_dim {dk} while q has head_dim {d}", "the same head_dim")
    if not 1 <= d <= ck.MAX_HEAD_DIM:
        ck.fail(ValueError, "q", f"head_dim {d}", f"1 <= head_dim <= {ck.MAX_HEAD_DIM}")
    if h_k == 0 or h % h_k:
        ck.fail(ValueError, "k_cache", f"{h_k} heads for {h} query heads",
                "heads_k dividing heads (heads % heads_k == 0: multi-head, GQA or MQA)")
    paged = block_table is not None
    if paged:
        if not hasattr(block_table, "dtype") or np.dtype(block_table.dtype) != np.int32:
            got = f"dtype {np.dtype(block_table.dtype)}" if hasattr(block_table, "dtype") else type(block_table).__name__
            ck.fail(TypeError, "block_table", got, "an int32 array (batch, max_blocks)")
        if block_table.ndim != 2 or int(block_table.shape[0]) != b or int(block_table.shape[1]) < 1:
            ck.fail(ValueError, "block_table", f"shape {_shape(block_table)}",
                    f"(batch, max_blocks) = ({b}, >= 1)")
        if page < 16 or page % 16:
            ck.fail(ValueError, "k_cache", f"page size {page} (dimension 1 of a paged cache)",
                    "a multiple of 16 keys per page (16, 32, ..., 256, ...)")
        max_blocks = int(block_table.shape[1])
    else:
        if nb != b:
            ck.fail(ValueError, "k_cache", f"batch {nb} while q has batch {b}",
                    "the same batch for q and a contiguous cache (or a paged cache with block_table)")
        max_blocks = 1
    s_new = 0
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            if x.ndim != 4 or _shape(x)[0] != b or _shape(x)[2:] != (h_k, d) or _shape(x)[1] != _shape(k)[1]:
                ck.fail(ValueError, name, f"shape {_shape(x)}",
                        f"(batch, seqlen_new, heads_k, head_dim) = ({b}, seqlen_new, {h_k}, {d}), "
                        "k and v alike")
        s_new = int(k.shape[1])
    if cache_seqlens is not None and not _is_int(cache_seqlens):
        if not hasattr(cache_seqlens, "dtype") or np.dtype(cache_seqlens.dtype).kind not in "iu":
            got = (f"dtype {np.dtype(cache_seqlens.dtype)}" if hasattr(cache_seqlens, "dtype")
                   else type(cache_seqlens).__name__)
            ck.fail(TypeError, "cache_seqlens", got, "None, an int, or an int32 array (batch,)")
        if _shape(cache_seqlens) != (b,):
            ck.fail(ValueError, "cache_seqlens", f"shape {_shape(cache_seqlens)}", f"an int or shape ({b},)")
    if cache_seqlens is None and k is not None:
        ck.fail(ValueError, "cache_seqlens", "None with new rows k / v",
                "the cache lengths (an int or an int32 array (batch,)) telling where k / v go")
    rd = ro = 0
    if (rotary_cos is None) != (rotary_sin is None):
        ck.fail(TypeError, "rotary_sin" if rotary_cos is not None else "rotary_cos",
                "None while the other is given", "both rotary_cos and rotary_sin or neither")
    if rotary_cos is not None:
        if k is None:
            ck.fail(ValueError, "rotary_cos", "given without new rows k / v",
                    "rotary only with k and v (as FlashAttention: q and the new keys are rotated)")
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not hasattr(x, "dtype") or np.dtype(x.dtype).kind != "f" and np.dtype(x.dtype) not in ck.ACCEPTED_DTYPES:
                got = f"dtype {np.dtype(x.dtype)}" if hasattr(x, "dtype") else type(x).__name__
                ck.fail(TypeError, name, got, "a float array (seqlen_ro, rotary_dim / 2)")
            if x.ndim != 2 or _shape(x) != _shape(rotary_cos) or not 1 <= 2 * int(x.shape[1]) <= d:
                ck.fail(ValueError, name, f"shape {_shape(x)}",
                        f"(seqlen_ro, rotary_dim / 2) with 2 <= rotary_dim <= head_dim = {d}, "
                        "rotary_cos and rotary_sin alike")
        rd, ro = 2 * int(rotary_cos.shape[1]), int(rotary_cos.shape[0])
    if not _is_int(num_splits) or num_splits < 0:
        ck.fail(ValueError, "num_splits", repr(num_splits), "an int >= 0 (0: the planner's choice)")
    return KVDims(b, s_q, h, h_k, d, s_new, paged, page, nb, max_blocks, rd, ro)


def check_values(dims: KVDims, lens, block_table=None, q_per_row: bool = False) -> None:
    """Host values: lens (int64 [batch]) and, when given, the used block_table entries (host
    array). Raises ValueError naming the argument."""
    lens = np.asarray(lens, dtype=np.int64)
    cap = dims.capacity
    bad = np.nonzero((lens < 0) | (lens + dims.seqlen_new > cap))[0]
    if bad.size:
        i = int(bad[0])
        ck.fail(ValueError, "cache_seqlens",
                f"{int(lens[i])} at batch entry {i} (+ {dims.seqlen_new} new rows)",
                f"0 <= cache_seqlens and cache_seqlens + seqlen_new <= {cap} (the cache's capacity"
                + (f": {dims.max_blocks} blocks x {dims.page_size} keys)" if dims.paged else ")"))
    if dims.rotary_dim:
        need = lens + max(dims.seqlen_new, dims.seqlen_q if q_per_row else 1)
        bad = np.nonzero(need > dims.seqlen_ro)[0]
        if bad.size:
            i = int(bad[0])
            ck.fail(ValueError, "rotary_cos",
                    f"{dims.seqlen_ro} rows for positions up to {int(need[i]) - 1} (batch entry {i})",
                    "a row per position: seqlen_ro > cache_seqlens + the new rows' offsets")
    if block_table is not None:
        bt = np.asarray(block_table)
        used = -(-(lens + dims.seqlen_new) // dims.page_size)               # [batch]
        cols = np.arange(bt.shape[1])[None, :]
        bad_mask = (cols < used[:, None]) & ((bt < 0) | (bt >= dims.num_blocks))
        if bad_mask.any():
            i, j = (int(x[0]) for x in np.nonzero(bad_mask))
            ck.fail(ValueError, "block_table", f"{int(bt[i, j])} at [{i}, {j}] (a used entry)",
                    f"block indices in [0, {dims.num_blocks}) for the blocks holding each entry's keys")


def _q_per_row(opts) -> bool:
    """q rotated at cache_seqlens + i (causal or a window), else every row at cache_seqlens."""
    return opts.window_left != -1 or opts.window_right != -1


def _host_values(x):
    """A small integer array's values on the host (NumPy), or None for a GPU array."""
    if isinstance(x, np.ndarray):
        return x
    return None


def attention_with_kvcache(q: Array, k_cache: Array, v_cache: Array, k: Optional[Array] = None,
                           v: Optional[Array] = None, *,
                           cache_seqlens: Union[None, int, Array] = None,
                           block_table: Optional[Array] = None,
                           rotary_cos: Optional[Array] = None, rotary_sin: Optional[Array] = None,
                           rotary_interleaved: bool = False, causal: bool = False,
                           window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                           softcap: Optional[float] = None, alibi_slopes: Optional[Array] = None,
                           scale: Optional[float] = None, return_lse: bool = False,
                           num_splits: int = 0) -> Union[Array, Tuple[Array, Array]]:
    """Attention against a key/value cache, with in-place append (FlashAttention's
    ``flash_attn_with_kvcache``).

    Parameters
    ----------
    q : (batch, seqlen_q, heads, head_dim)
    k_cache, v_cache : (batch, seqlen_cache, heads_k, head_dim) (contiguous), or with
        ``block_table`` (num_blocks, page_size, heads_k, head_dim) (paged; page_size a multiple
        of 16). Updated in place when k / v are given.
    k, v : (batch, seqlen_new, heads_k, head_dim) or None: new rows written into the cache at
        positions cache_seqlens[i] + 0.. before attending.
    cache_seqlens : int or int32 (batch,): keys in the cache before the append. None: the whole
        cache (seqlen_cache, or max_blocks * page_size) holds keys (not with k / v).
    block_table : int32 (batch, max_blocks): entry i's key j lives in page
        block_table[i, j // page_size] at row j % page_size.
    rotary_cos, rotary_sin : (seqlen_ro, rotary_dim / 2), with k / v only: the new keys are
        rotated at positions cache_seqlens + 0.., q at cache_seqlens + 0.. when causal or a
        window is set, else every row of q at cache_seqlens. The first rotary_dim columns rotate.
    rotary_interleaved : pairs (0, 1), (2, 3), ... (GPT-J) when True; (j, j + rotary_dim / 2)
        (GPT-NeoX) when False (the default here; FlashAttention's default is True).
    causal, window, softcap, alibi_slopes, scale : as ``attention``; causal and window are
        aligned bottom-right to each entry's key count after the append.
    return_lse : also return lse, float32 (batch, heads, seqlen_q) (float64 for float64).
    num_splits : key splits per (batch, kv head) on the GPU: 0 the planner's choice, 1 no split.

    Returns
    -------
    out : (batch, seqlen_q, heads, head_dim) in q's dtype [, lse].

    Host (NumPy) arrays run on the CPU implementation (the cache is updated where it lives);
    GPU arrays on the GPU. Lengths and used block-table entries out of range raise ValueError
    (device-held values: see ``set_device_checks``).
    """
    key = _fast_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
                    rotary_interleaved, causal, window, softcap, alibi_slopes, scale, return_lse,
                    num_splits)
    if key is not None:
        ent = _FAST.get(key)
        if ent is not None:
            res = ent.run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos,
                          rotary_sin)
            if res is not None:
                return res
    ck.check_present({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    ck.check_flag("return_lse", return_lse)
    ck.check_flag("rotary_interleaved", rotary_interleaved)
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v}
    backend = _interop.resolve("auto", arrays, gpu_covers=False)
    qb, kc, vc, kn, vn = (backend.take(x) if x is not None else None for x in (q, k_cache, v_cache, k, v))
    # (GPU arrays are taken zero-copy: writes into the cache reach the caller's arrays)
    small = {}
    for name, x in (("cache_seqlens", cache_seqlens), ("block_table", block_table),
                    ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if x is None or (name == "cache_seqlens" and _is_int(x)):
            small[name] = x
            continue
        if isinstance(x, np.ma.MaskedArray) or not (hasattr(x, "dtype") and hasattr(x, "shape")):
            ck.fail(TypeError, name, f"{type(x).__module__}.{type(x).__qualname__}",
                    "a NumPy or CuPy array")
        small[name] = x if isinstance(x, np.ndarray) else _interop._to_cupy(x)
    dims = check_kvcache(qb, kc, vc, kn, vn, cache_seqlens=small["cache_seqlens"],
                         block_table=small["block_table"], rotary_cos=small["rotary_cos"],
                         rotary_sin=small["rotary_sin"], num_splits=num_splits)
    dtype = np.dtype(qb.dtype)
    xp = backend.xp
    opts = ck.make_options(
        ck.Dims(dims.batch, dims.seqlen_q, dims.capacity, dims.heads, dims.heads_k, dims.head_dim,
                dims.head_dim), xp, causal=causal, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, scale=scale, dtype=dtype)
    per_row = _q_per_row(opts)
    if kn is not None and backend.where == "cpu":
        for name, x in (("k_cache", kc), ("v_cache", vc)):
            if not x.flags.writeable:
                ck.fail(ValueError, name, "a read-only array", "a writable cache (k / v are written into it)")

    # lengths and block table: host values where they are on the host
    cs = small["cache_seqlens"]
    if cs is None:
        lens_host = np.full(dims.batch, dims.capacity, dtype=np.int64)
    elif _is_int(cs):
        lens_host = np.full(dims.batch, int(cs), dtype=np.int64)
    else:
        h = _host_values(cs) if backend.where == "gpu" else _to_host(cs)
        lens_host = None if h is None else h.astype(np.int64)
        if lens_host is not None and lens_host.size and (lens_host.max() > _INT32_MAX):
            ck.fail(ValueError, "cache_seqlens", f"values up to {int(lens_host.max())}", "int32 values")
    bt = small["block_table"]
    bt_host = None if bt is None else (_host_values(bt) if backend.where == "gpu" else _to_host(bt))
    if lens_host is not None:
        check_values(dims, lens_host, bt_host, per_row)

    if backend.where == "cpu":
        from . import cpu_kvcache

        rot = None
        if dims.rotary_dim:
            rot = (_to_host(small["rotary_cos"]), _to_host(small["rotary_sin"]),
                   bool(rotary_interleaved), per_row)
        out, lse = cpu_kvcache.forward(qb, kc, vc, kn, vn, lens_host, bt_host, rot, opts)
        if lse.dtype != (np.float64 if dtype == np.float64 else np.float32):
            lse = lse.astype(np.float32)
        out, lse = backend.give_back(out), backend.give_back(lse)
        return (out, lse) if return_lse else out
    return _gpu(backend, dims, opts, qb, kc, vc, kn, vn, small, lens_host, bt_host, per_row,
                bool(rotary_interleaved), return_lse, num_splits, causal, window, softcap,
                alibi_slopes, scale, key)


def _to_host(x):
    if x is None or isinstance(x, np.ndarray):
        return x
    return x.get()


def _gpu(backend, dims, opts, q, kc, vc, kn, vn, small, lens_host, bt_host, per_row, interleaved,
         return_lse, num_splits, causal, window, softcap, alibi_slopes, scale, key):
    import cupy

    from .gpu import decode, decode_route, device

    device.when_limit_changes(_FAST.clear)   # its launches are planned for the smem limit
    dtype = np.dtype(q.dtype)
    if dtype == np.float64:
        raise NotImplementedError(
            "attention_with_kvcache: float64 GPU caches (no GPU kernel; float64 runs on the CPU "
            "implementation with NumPy arrays)")
    with cupy.cuda.Device(backend.device_id):
        cs = small["cache_seqlens"]
        if cs is None or _is_int(cs):
            cs_dev, const = None, int(lens_host[0]) if dims.batch else 0
        else:
            cs_dev, const = cupy.ascontiguousarray(cupy.asarray(cs), dtype=np.int32), 0
        bt = small["block_table"]
        bt_dev = None if bt is None else cupy.asarray(bt)
        if bt_dev is not None and bt_dev.strides[1] != 4:
            bt_dev = cupy.ascontiguousarray(bt_dev)
        rot = None
        if dims.rotary_dim:
            rot = tuple(cupy.ascontiguousarray(cupy.asarray(small[n]), dtype=np.float32)
                        for n in ("rotary_cos", "rotary_sin")) + (interleaved, per_row)
        check_device = _DEVICE_CHECKS[0] and (lens_host is None or (bt is not None and bt_host is None))
        page, max_blocks = dims.page_size, dims.max_blocks
        common = dict(cache_seqlens=cs_dev, seqlens_const=const, block_table=bt_dev,
                      page_size=page, max_blocks=max_blocks, rot=rot, opts=opts,
                      check_device=check_device)
        out = cupy.empty((dims.batch, dims.seqlen_q, dims.heads, dims.head_dim), dtype)
        lse = cupy.empty((dims.batch, dims.heads, dims.seqlen_q), np.float32)
        cc = device.info(backend.device_id)[0]
        q_given = q
        if not decode.aligned(q):
            q = cupy.ascontiguousarray(q)
        reason = decode.covers(q, kc, cc) if out.size else "empty output"
        if reason is None and not decode.aligned(vc):
            reason = "v_cache strides or base address not multiples of 16 bytes"
        if reason is None:
            max_keys = dims.capacity if lens_host is None else int(lens_host.max(initial=0)) + dims.seqlen_new
            ent, bits = decode_route.attend(q, kc, vc, kn, vn, out, lse, num_splits=num_splits,
                                            max_keys=max_keys, **common)
            _raise_device_bits(bits, dims)
            direct = rot is None or (_same(rot[0], small["rotary_cos"])
                                     and _same(rot[1], small["rotary_sin"]))
            if (key is not None and direct and q is q_given and (bt is None or _same(bt_dev, bt))
                    and (cs_dev is None or _same(cs_dev, cs))):
                if len(_FAST) >= _FAST_MAX:
                    _FAST.clear()
                _FAST[key] = _FastCall(ent, dims, per_row, check_device, return_lse,
                                       backend.device_id, cs_dev is None)
        else:
            q_att, bits = decode.prepare(q, kc, vc, kn, vn, **common)
            _raise_device_bits(bits, dims)
            if out.size:
                _gather_attend(dims, q_att, kc, vc, bt_dev, cs_dev, lens_host, out, lse,
                               causal, window, softcap, alibi_slopes, scale)
        out, lse = backend.give_back(out), backend.give_back(lse)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# Repeated GPU calls (a decode loop): a call whose CuPy arrays and options repeat the shapes,
# strides, dtypes, device and option values of a call that went through the full path on the
# decode kernel reuses that call's validation and its decode.Launch (planned Params); per call
# only the pointers, an int cache_seqlens' range and the base addresses' alignment are checked.
# ----------------------------------------------------------------------------------------------
_FAST = {}
_FAST_MAX = 512


def _frozen(value):
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_frozen(x) for x in value))
    return (type(value), value)


def _same(used, given) -> bool:
    """True when the launch used the caller's own array ``given`` (no conversion or copy)."""
    cp = _interop.cupy_module()
    return (type(given) is cp.ndarray and used.data.ptr == given.data.ptr
            and used.dtype == given.dtype and used.strides == given.strides)


def _fast_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
              rotary_interleaved, causal, window, softcap, alibi_slopes, scale, return_lse,
              num_splits):
    """Hashable signature of a call on CuPy arrays (None: not eligible)."""
    if alibi_slopes is not None:
        return None
    cp = _interop.cupy_module()
    if cp is None or type(q) is not cp.ndarray:
        return None
    parts = []
    for x in (q, k_cache, v_cache, k, v, block_table, rotary_cos, rotary_sin):
        if x is None:
            parts.append(None)
        elif type(x) is cp.ndarray:
            parts.append((x.shape, x.strides, x.dtype, x.data.device_id))
        else:
            return None
    cs = cache_seqlens
    if type(cs) is int:
        # the split count is planned from the length: one entry per power-of-two bucket
        cs_key = ("int", max(cs + (0 if k is None else int(k.shape[1])), 1).bit_length())
    elif cs is None:
        cs_key = None
    elif type(cs) is cp.ndarray:
        cs_key = (cs.shape, cs.strides, cs.dtype, cs.data.device_id)
    else:
        return None
    try:
        key = (tuple(parts), cs_key, _frozen(rotary_interleaved), _frozen(causal),
               None if window is None else _frozen(window), _frozen(softcap), _frozen(scale),
               _frozen(return_lse), _frozen(num_splits), _DEVICE_CHECKS[0])
        hash(key)
    except TypeError:
        return None
    return key


class _FastCall:
    __slots__ = ("launch", "dims", "per_row", "check", "return_lse", "device_id", "int_lens",
                 "out_shape", "lse_shape", "dtype", "cp")

    def __init__(self, launch, dims, per_row, check, return_lse, device_id, int_lens):
        self.launch, self.dims, self.per_row, self.check = launch, dims, per_row, check
        self.return_lse, self.device_id, self.int_lens = return_lse, device_id, int_lens
        self.out_shape = (dims.batch, dims.seqlen_q, dims.heads, dims.head_dim)
        self.lse_shape = (dims.batch, dims.heads, dims.seqlen_q)
        self.dtype = launch.dtype
        self.cp = _interop.cupy_module()

    def run(self, q, kc, vc, k, v, cs, bt, cos, sin):
        """The call's results, or None (the full path must run: another current device, an
        unaligned base address, a length to report through the full path's errors)."""
        cp = self.cp
        if cp.cuda.runtime.getDevice() != self.device_id or (q.data.ptr | kc.data.ptr | vc.data.ptr) & 15:
            return None
        dims = self.dims
        if self.int_lens:
            n = dims.capacity if cs is None else cs
            if n < 0 or n + dims.seqlen_new > dims.capacity:
                return None
            if dims.rotary_dim and n + max(dims.seqlen_new, dims.seqlen_q if self.per_row else 1) > dims.seqlen_ro:
                return None
            cs_ptr, const = 0, n
        else:
            cs_ptr, const = cs.data.ptr, 0
        out = cp.empty(self.out_shape, self.dtype)
        lse = cp.empty(self.lse_shape, np.float32)
        bits = self.launch(q, kc, vc, k, v, out, lse, cs_ptr, const,
                           0 if bt is None else bt.data.ptr, 0 if cos is None else cos.data.ptr,
                           0 if sin is None else sin.data.ptr, 0, self.check)
        _raise_device_bits(bits, dims)
        return (out, lse) if self.return_lse else out


def _raise_device_bits(bits, dims):
    from .gpu import plan_decode as pd

    if bits & pd.ERR_LENGTH:
        ck.fail(ValueError, "cache_seqlens", "a value out of range (checked on the GPU)",
                f"0 <= cache_seqlens and cache_seqlens + seqlen_new <= {dims.capacity}")
    if bits & pd.ERR_BLOCK:
        ck.fail(ValueError, "block_table", "an index out of range in a used entry (checked on the GPU)",
                f"block indices in [0, {dims.num_blocks})")
    if bits & pd.ERR_ROTARY:
        ck.fail(ValueError, "rotary_cos", f"{dims.seqlen_ro} rows, fewer than the positions used",
                "seqlen_ro > cache_seqlens + the new rows' offsets")


def _gather_attend(dims, q_att, kc, vc, bt_dev, cs_dev, lens_host, out, lse, causal, window,
                   softcap, alibi_slopes, scale):
    """The gather path: each entry's keys gathered into packed arrays, attention_varlen."""
    import cupy

    from .api import attention_varlen

    lens = lens_host if lens_host is not None else cs_dev.get().astype(np.int64)
    n = lens + dims.seqlen_new
    b, s_q, h, d = dims.batch, dims.seqlen_q, dims.heads, dims.head_dim
    bt = None if bt_dev is None else bt_dev.get()
    ks, vs = [], []
    for i in range(b):
        if bt is None:
            ks.append(kc[i, :n[i]])
            vs.append(vc[i, :n[i]])
        else:
            pages = cupy.asarray(bt[i, :-(-int(n[i]) // dims.page_size)])
            ks.append(kc[pages].reshape(-1, dims.heads_k, d)[:n[i]])
            vs.append(vc[pages].reshape(-1, dims.heads_k, d)[:n[i]])
    kp, vp = cupy.concatenate(ks), cupy.concatenate(vs)
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32))
    cu_q = cupy.arange(0, (b + 1) * s_q, s_q, dtype=np.int32)
    qp = cupy.ascontiguousarray(q_att).reshape(b * s_q, h, d)
    o, l = attention_varlen(qp, kp, vp, cu_q, cu_k, s_q, int(n.max(initial=0)), causal=causal,
                            window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                            scale=scale, return_lse=True)
    out[...] = o.reshape(b, s_q, h, d)
    lse[...] = l.reshape(h, b, s_q).transpose(1, 0, 2)
