"""The launcher's per-call writes into its cached Params record (no GPU: a stand-in kernel).

A launch writes the pointers of q, k, v, out, lse (and ALiBi) and the alignment flag into the
record of its shape signature and passes the record's bytes by value; everything else in the
record was planned once and must come through unchanged.
"""
import numpy as np
import pytest

from cupyflash.gpu import params as gpu_params, plan_fwd, plan_fwd_sm90

pytest.importorskip("cupy")  # the launchers import CuPy (no device needed to build a record)


def _entry(strides_ok=True, **plan_kw):
    from cupyflash.gpu import fwd_portable

    plan = plan_fwd.plan_forward("bfloat16", 2, 37, 53, 4, 2, 64, 64, scale=0.125, **plan_kw)
    seen = []

    def kernel(grid, block, args, shared_mem=0):  # reads the argument bytes at launch time
        (arg,) = args
        ptr = getattr(arg, "ptr", None)
        assert ptr == ent.arr.ctypes.data, "the argument must point at the record's bytes"
        seen.append((grid, block, shared_mem, ent.arr.copy()[0]))

    ent = fwd_portable.Launch(kernel, plan, strides_ok)
    return ent, plan, seen


def _pointers(rng, n, align=256):
    return [int(x) * align for x in rng.integers(1 << 20, 1 << 36, n)]


def test_launch_writes_the_call_pointers_and_keeps_the_plan(rng):
    ent, plan, seen = _entry()
    planned = plan.params.copy()
    qp, kp, vp, op, lp = _pointers(rng, 5)
    ent.launch(qp, kp, vp, op, lp)
    grid, block, smem, rec = seen[-1]
    assert (grid, block, smem) == (plan.grid, plan.block, plan.smem)
    assert [int(rec[n]) for n in ("q", "k", "v", "o", "lse", "alibi")] == [qp, kp, vp, op, lp, 0]
    assert rec["vec_ok"] == 1
    for name in gpu_params.PARAMS_DTYPE.names:
        if name not in ("q", "k", "v", "o", "lse", "alibi", "vec_ok"):
            assert np.array_equal(rec[name], planned[name]), name


@pytest.mark.parametrize("misaligned", ["q", "k", "v", "o"])
def test_launch_clears_vec_ok_for_an_unaligned_pointer(rng, misaligned):
    ent, _, seen = _entry()
    ptrs = dict(zip("qkvol", _pointers(rng, 5)))
    ptrs[misaligned] += 2  # one 16-bit element off a 16-byte boundary
    ent.launch(*ptrs.values())
    assert seen[-1][3]["vec_ok"] == 0
    ent.launch(*_pointers(rng, 5))  # the next aligned call sets it again
    assert seen[-1][3]["vec_ok"] == 1


def test_launch_keeps_vec_ok_off_when_strides_are_unaligned(rng):
    ent, _, seen = _entry(strides_ok=False)
    ent.launch(*_pointers(rng, 5))
    assert seen[-1][3]["vec_ok"] == 0


def test_launch_writes_alibi_pointer_and_batch_stride(rng):
    ent, _, seen = _entry(has_alibi=True)
    ptrs = _pointers(rng, 6)
    ent.launch(*ptrs[:5], ptrs[5], 4)
    rec = seen[-1][3]
    assert int(rec["alibi"]) == ptrs[5] and rec["alibi_stride_b"] == 4
    assert [int(rec[n]) for n in ("q", "k", "v", "o", "lse")] == ptrs[:5]


def _sm90_entry(monkeypatch, dtype="bfloat16", s=300):
    """A Hopper launch entry over stand-ins for [2, s, 4, 128] tensors: the kernels record their
    Params bytes, and the TMA encoder returns a descriptor that spells out its inputs."""
    from cupyflash.gpu import compile as gpu_compile
    from cupyflash.gpu import device as gpu_device
    from cupyflash.gpu import fwd_sm90
    from cupyflash.gpu import params as gpu_params
    from cupyflash.gpu import tma as gpu_tma

    shape, strides = (2, s, 4, 128), (s * 512, 512, 128, 1)
    plan = plan_fwd_sm90.plan_forward_sm90(dtype, 2, s, s, 4, 4, 128, 128, scale=0.1)
    portable = plan_fwd.plan_forward(dtype, 2, s, s, 4, 4, 128, 128, scale=0.1)
    for p_ in (plan, portable):
        gpu_params.write_strides(p_.params, [strides] * 4)
    seen = []

    def kernel_of(name):
        def kernel(grid, block, args, shared_mem=0):
            seen.append((name, np.frombuffer(
                bytes((__import__("ctypes").c_char * gpu_params.PARAMS_NBYTES).from_address(args[0].ptr)),
                gpu_params.PARAMS_DTYPE)[0]))
        return kernel

    monkeypatch.setattr(gpu_tma, "encode", lambda dt, ptr, dims, st, box: np.array(
        [ptr, *dims, *st, *box] + [0] * 4, np.uint64))
    monkeypatch.setattr(gpu_compile, "get_function", lambda variant, dev, extra=(): kernel_of("portable"))
    monkeypatch.setattr(gpu_device, "current_stream", lambda: type("S", (), {"ptr": 77})())
    monkeypatch.setattr(gpu_device, "sched_counter", lambda dev, stream: 4096 + stream)
    monkeypatch.setattr(gpu_device, "split_buffers", lambda dev, stream, ws, n: (8192 + ws, 12288 + n))
    monkeypatch.setattr(gpu_device, "to_device", lambda a: type("D", (), {"data": type(
        "P", (), {"ptr": 16384 + a.size})()})())
    itemsize = 4 if dtype == "float32" else 2
    maps = tuple(gpu_tma.tma_tensor(shape, strides, itemsize, rows) for rows in (128, 128, 128))
    ent = fwd_sm90._Sm90Launch(kernel_of("sm90"), plan, dtype, maps, portable, True, 0)
    return ent, plan, seen


def test_sm90_launch_writes_descriptors_per_pointer_tuple(rng, monkeypatch):
    ent, plan, seen = _sm90_entry(monkeypatch)
    ptrs = _pointers(rng, 5)
    assert ent.launch(*ptrs) == plan.variant.name
    name, rec = seen[-1]
    assert name == "sm90"
    assert [int(rec[n]) for n in ("q", "k", "v", "o", "lse")] == ptrs
    for field, ptr, (dims, st, box) in zip(gpu_params.PARAMS_TMA_FIELDS, ptrs, ent.maps):
        assert list(rec[field][:12]) == [ptr, *dims, *st, *box]
    assert rec["s_q"] == 300 and rec["num_m_blocks"] == 3      # the plan came through
    assert int(rec["sched"]) == 4096 + 77                      # this stream's tile counter
    assert not plan.variant.split and int(rec["split_table"]) == 0   # tiles of three key tiles
    ent.launch(*ptrs)                                           # the same buffers: a cached record
    assert len(ent.records) == 1 and seen[-1][1].tobytes() == rec.tobytes()
    other = _pointers(rng, 5)
    ent.launch(*other)
    assert len(ent.records) == 2 and int(seen[-1][1]["q"]) == other[0]
    assert int(ent.records[(*ptrs, 77)][1][0]["q"]) == ptrs[0]   # earlier record untouched


def test_sm90_launch_writes_the_split_tail(rng, monkeypatch):
    """64 work tiles of 8 key tiles on 132 SMs: two pieces each. The record carries the work
    items' table (uploaded once), this stream's workspace and counters, and is keyed by them."""
    ent, plan, seen = _sm90_entry(monkeypatch, s=1024)
    ptrs = _pointers(rng, 5)
    ent.launch(*ptrs)
    rec = seen[-1][1]
    pieces = int(plan.params["split_pieces"])
    assert plan.variant.split and pieces == 128 and len(plan.split) == pieces
    assert rec["split_pieces"] == pieces and rec["split_first"] == 0
    assert int(rec["split_table"]) == 16384 + 4 * pieces
    assert int(rec["split_ws"]) == 8192 + plan_fwd_sm90.sm90_split_ws_bytes(plan.variant, pieces)
    assert int(rec["split_count"]) == 12288 + 64 * 2           # tiles x consumers
    key = (*ptrs, 77, int(rec["split_ws"]), int(rec["split_count"]))
    assert list(ent.records) == [key]
    table = ent.split_table
    ent.launch(*_pointers(rng, 5))
    assert ent.split_table is table and len(ent.records) == 2


@pytest.mark.parametrize("which,offset", [("q", 2), ("k", 8), ("v", 2), ("o", 2)])
def test_sm90_launch_falls_back_for_unaligned_bases(rng, monkeypatch, which, offset):
    ent, _, seen = _sm90_entry(monkeypatch)
    ptrs = dict(zip("qkvol", _pointers(rng, 5)))
    ptrs[which] += offset
    name = ent.launch(*ptrs.values())
    if which == "o" and offset % 4 == 0:
        assert seen[-1][0] == "sm90"
    else:
        assert seen[-1][0] == "portable" and name.startswith("fwd_bf16_d128")
        assert [int(seen[-1][1][n]) for n in "qkvo"] == [ptrs[c] for c in "qkvo"]


@pytest.mark.parametrize("offset", [4, 8, 16])
def test_sm90_float32_launch_needs_16_byte_output_bases(rng, monkeypatch, offset):
    """The float32 Hopper forward stores out in 16-byte quads: other bases run the portable kernel."""
    ent, _, seen = _sm90_entry(monkeypatch, "float32")
    ptrs = dict(zip("qkvol", _pointers(rng, 5)))
    ptrs["o"] += offset
    name = ent.launch(*ptrs.values())
    assert seen[-1][0] == ("sm90" if offset % 16 == 0 else "portable")
    assert name.startswith("fwd90_f32x3_d128" if offset % 16 == 0 else "fwd_f32x3_d128"), name


def test_forward_varlen_names_a_bad_kernel_choice():
    from cupyflash.gpu import fwd as gpu_fwd
    with pytest.raises(ValueError, match=r"kernel='fwd': accepted 'auto', 'sm90', 'portable'"):
        gpu_fwd.forward_varlen(None, None, None, None, None, 1, 1, None, None, None, kernel="fwd")


class _FakeBias:
    """What bias_pair_ok reads of a CuPy array: shape, strides, itemsize, data.ptr."""

    def __init__(self, shape, strides, itemsize, ptr):
        from types import SimpleNamespace
        self.shape, self.strides, self.itemsize = shape, strides, itemsize
        self.data = SimpleNamespace(ptr=ptr)


@pytest.mark.parametrize("shape,elem_strides,itemsize,ptr,s_k,ok", [
    ((2, 4, 8, 6), (192, 48, 6, 1), 2, 256, 6, True),     # contiguous 16-bit (b, h, s_q, s_k)
    ((1, 4, 8, 6), (0, 48, 6, 1), 4, 256, 6, True),       # float32, broadcast over batch
    ((2, 1, 1, 6), (6, 0, 0, 1), 2, 256, 6, True),        # key padding (b, 1, 1, s_k)
    ((2, 4, 8, 8), (256, 64, 8, 1), 2, 256, 8, True),     # row-padded view (even row stride)
    ((2, 4, 8, 5), (160, 40, 5, 1), 2, 256, 5, False),    # odd s_k: no column pairs
    ((2, 4, 8, 6), (192, 48, 1, 8), 2, 256, 6, False),    # keys not contiguous
    ((2, 4, 8, 6), (192, 48, 7, 1), 2, 256, 6, False),    # odd row stride: pairs misaligned
    ((2, 4, 8, 6), (192, 48, 6, 1), 2, 258, 6, False),    # base not 4-byte aligned
    ((2, 4, 8, 6), (192, 48, 6, 1), 4, 260, 6, False),    # float32 base not 8-byte aligned
], ids=["f16", "f32_bcast", "key_pad", "row_padded", "odd_sk", "keys_strided", "odd_row",
        "base16", "base32"])
def test_bias_pair_ok(shape, elem_strides, itemsize, ptr, s_k, ok):
    """The Hopper forward's bias path needs column pairs (j, j + 1) in one aligned load."""
    from cupyflash.gpu import operands as gpu_operands
    b = _FakeBias(shape, tuple(st * itemsize for st in elem_strides), itemsize, ptr)
    assert gpu_operands.bias_pair_ok(b, s_k) is ok


def test_sm90_backward_varlen_launch_records(monkeypatch):
    """The VARLEN Hopper backward: the main kernel's record has b = sequences and num_n_blocks =
    the longest sequence's key tiles (its grid: min(SMs, work tiles)); the helper kernels keep
    b = 1 and see the packed tokens as one batch (grid z = 1)."""
    import ml_dtypes

    from cupyflash.gpu import bwd_sm90
    from cupyflash.gpu import compile as gpu_compile
    from cupyflash.gpu import device as gpu_device
    from cupyflash.gpu import plan_bwd
    from cupyflash.gpu import plan_bwd_sm90
    from cupyflash.gpu import tma as gpu_tma

    bf16 = np.dtype(ml_dtypes.bfloat16)
    total_q, total_k, h, h_k, d = 1500, 1400, 4, 2, 128

    class Arr:   # a packed [1, total, heads, d] stand-in for a CuPy array
        def __init__(self, rows, heads, ptr):
            self.shape, self.dtype = (1, rows, heads, d), bf16
            self.strides = (rows * heads * d * 2, heads * d * 2, d * 2, 2)
            self.data = type("M", (), {"ptr": ptr})()

    q, dout = Arr(total_q, h, 1 << 20), Arr(total_q, h, 3 << 20)
    k, v = Arr(total_k, h_k, 5 << 20), Arr(total_k, h_k, 7 << 20)
    plan = plan_bwd.plan_backward_varlen("bfloat16", 8, total_q, total_k, 700, 650, h, h_k, d, d,
                                         scale=0.1, window_right=0)
    prm = plan.params.copy()
    prm["dk"], prm["dv"], prm["o"] = 9 << 20, 11 << 20, 13 << 20
    seen = []

    def kernel_of(name):
        def kernel(grid, block, args, shared_mem=0):   # args: (the record, a numpy.void)
            seen.append((name, grid, np.array(args[0], gpu_params.PARAMS_DTYPE)[()]))
        return kernel

    monkeypatch.setattr(gpu_tma, "encode", lambda *a: np.zeros(16, np.uint64))
    monkeypatch.setattr(gpu_device, "current_stream", lambda: type("S", (), {"ptr": 77})())
    monkeypatch.setattr(gpu_device, "sched_counter", lambda dev, stream: 4096)
    monkeypatch.setattr(gpu_compile, "get_functions", lambda variant, dev: tuple(
        kernel_of(n) for n in ("main", "pre", "pre_portable", "dq")))
    variant = plan_bwd_sm90.variant_for("bf16_t", d, True, varlen=True)
    assert bwd_sm90.launch(variant, prm, plan.pre_grid, q, k, v, dout, 0, 132, (8, 650)) == variant.name
    assert [s[0] for s in seen] == ["pre", "main", "dq"]
    (_, pre_grid, pre_rec), (_, main_grid, main_rec), (_, dq_grid, dq_rec) = seen
    num_n = -(-650 // 128)
    assert main_grid == (min(132, num_n * h_k * 8), 1, 1)
    assert (main_rec["b"], main_rec["num_n_blocks"]) == (8, num_n)
    assert pre_grid[1:] == (h, 1) and dq_grid[1:] == (h, 1)
    for rec in (pre_rec, dq_rec):
        assert rec["b"] == 1 and rec["s_q"] == total_q
    assert main_rec["s_q"] == total_q and main_rec["s_k"] == total_k
    assert main_rec["varlen_bottom_right"] == 1 and main_rec["diag_offset"] == 0


@pytest.mark.parametrize("nseq,max_k,refused", [(8, 650, False), (65535, 1 << 17, False), (65535, 1 << 18, True)])
def test_sm90_backward_varlen_work_count_fits_an_int(monkeypatch, nseq, max_k, refused):
    """The VARLEN kernel counts work tiles (longest sequence's key tiles x kv heads x sequences)
    in an int: a call past 2^31 - 1 stays on the portable kernel, and kernel="sm90" names why."""
    import ml_dtypes

    from cupyflash.gpu import bwd as gpu_bwd, device as gpu_device, plan_bwd
    from cupyflash._options import Options

    bf16 = np.dtype(ml_dtypes.bfloat16)
    d, h, h_k = 128, 32, 32

    class Arr:   # a packed [1, total, heads, d] stand-in for a CuPy array
        def __init__(self, rows, heads):
            self.shape, self.dtype = (1, rows, heads, d), bf16
            self.strides = (rows * heads * d * 2, heads * d * 2, d * 2, 2)

    q = k = v = dout = Arr(1 << 20, h)
    monkeypatch.setattr(gpu_device, "info", lambda dev: (90, 227 * 1024, 132))
    plan = plan_bwd.plan_backward_varlen("bfloat16", 8, 1 << 20, 1 << 20, 700, 650, h, h_k, d, d,
                                         scale=0.1)
    opts = Options(scale=0.1)
    args = (plan, "bfloat16", dout, q, k, v, opts, 0, 227 * 1024, 132)
    got = gpu_bwd._hopper_launcher(*args, forced=False, varlen=(nseq, max_k))
    assert (got is None) == refused
    if refused:
        with pytest.raises(ValueError, match=r"kernel='sm90'.*exceed 2\^31 - 1 work tiles"):
            gpu_bwd._hopper_launcher(*args, forced=True, varlen=(nseq, max_k))


@pytest.mark.parametrize("kernel", ["sm80", "hopper", 3])
def test_backward_names_a_bad_kernel_choice(kernel):
    from cupyflash.gpu import bwd as gpu_bwd
    with pytest.raises(ValueError, match=r"accepted None / 'auto', 'sm90', 'portable'"):
        gpu_bwd.backward(*([None] * 9), None, kernel=kernel)


def test_dbias_mode_bits_mirror_params_cuh():
    """plan_bwd's DBIAS_* constants are the values kernels_cu/common/params.cuh defines."""
    import pathlib
    import re

    from cupyflash.gpu import plan_bwd

    src = (pathlib.Path(__file__).parents[2] / "kernels_cu" / "common" / "params.cuh").read_text()
    defined = {m[0]: int(m[1]) for m in re.findall(r"#define (DBIAS_\w+) (\d+)", src)}
    assert set(defined) == {"DBIAS_ROWS", "DBIAS_ATOMIC", "DBIAS_SLAB_B", "DBIAS_SLAB_H",
                            "DBIAS_STORE", "DBIAS_SCHED_B"}
    for name, value in defined.items():
        assert getattr(plan_bwd, name) == value, name


def test_backward_varlen_kernel_choice_is_checked_first():
    from cupyflash.gpu import bwd as gpu_bwd
    with pytest.raises(ValueError, match=r"kernel='sm80': accepted 'auto', 'sm90', 'portable'"):
        gpu_bwd.backward_varlen(*([None] * 13), None, kernel="sm80")


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_sm90_backward_det_workspace(monkeypatch, varlen):
    """A DET launch allocates one float32 accumulator (dq_accum_slab floats) followed by its
    int32 dQ semaphores (plan_bwd_sm90.dq_semaphores: rows / 64 rounded up + one per (sequence,
    head) slab), zeroes only the semaphores (a memset on the current stream: pre zeroes the
    accumulator), and hands every kernel a record with deterministic = 0 (the portable
    flash_bwd_pre then zeroes the accumulator too) and dq_accum = the workspace, the main kernel
    det_sched (plan_bwd_sm90.det_sched); the caller's record is left as it was."""
    import ml_dtypes

    from cupyflash.gpu import bwd_sm90
    from cupyflash.gpu import compile as gpu_compile
    from cupyflash.gpu import device as gpu_device
    from cupyflash.gpu import plan_bwd
    from cupyflash.gpu import plan_bwd_sm90
    from cupyflash.gpu import tma as gpu_tma

    bf16 = np.dtype(ml_dtypes.bfloat16)
    b, s_q, s_k, h, h_k, d = (1, 1500, 1400, 4, 2, 128) if varlen else (2, 333, 517, 6, 2, 64)
    nseq = 8

    class Arr:   # a [b, s, heads, d] stand-in for a CuPy array
        def __init__(self, bb, rows, heads, ptr):
            self.shape, self.dtype = (bb, rows, heads, d), bf16
            self.strides = (rows * heads * d * 2, heads * d * 2, d * 2, 2)
            self.data = type("M", (), {"ptr": ptr})()

    q, dout = Arr(b, s_q, h, 1 << 20), Arr(b, s_q, h, 3 << 20)
    k, v = Arr(b, s_k, h_k, 5 << 20), Arr(b, s_k, h_k, 7 << 20)
    if varlen:
        plan = plan_bwd.plan_backward_varlen("bfloat16", nseq, s_q, s_k, 700, 650, h, h_k, d, d,
                                             scale=0.1, window_right=0, deterministic=True)
    else:
        plan = plan_bwd.plan_backward("bfloat16", b, s_q, s_k, h, h_k, d, d, scale=0.1,
                                      deterministic=True)
    prm = plan.params.copy()
    prm["dk"], prm["dv"], prm["o"], prm["dq_accum"] = 9 << 20, 11 << 20, 13 << 20, 12345
    before = prm.copy()
    seen, allocs, memsets = [], [], []

    class Ptr:
        def __init__(self, ptr):
            self.ptr = ptr

        def __add__(self, off):
            return Ptr(self.ptr + off)

        def memset_async(self, value, size):
            memsets.append((self.ptr, value, size))

    class FakeCupy:
        float32 = np.float32

        @staticmethod
        def empty(n, dtype):
            allocs.append((n, np.dtype(dtype)))
            return type("A", (), {"data": Ptr(1 << 30)})()

    def kernel_of(name):
        def kernel(grid, block, args, shared_mem=0):
            seen.append((name, np.array(args[0], gpu_params.PARAMS_DTYPE)[()]))
        return kernel

    monkeypatch.setattr(bwd_sm90, "cupy", FakeCupy)
    monkeypatch.setattr(gpu_tma, "encode", lambda *a: np.zeros(16, np.uint64))
    monkeypatch.setattr(gpu_device, "current_stream", lambda: type("S", (), {"ptr": 77})())
    monkeypatch.setattr(gpu_device, "sched_counter", lambda dev, stream: 4096)
    monkeypatch.setattr(gpu_compile, "get_functions", lambda variant, dev: tuple(
        kernel_of(n) for n in ("main", "pre", "pre_portable", "dq")))
    variant = plan_bwd_sm90.variant_for("bf16_t", d, varlen, varlen=varlen, det=True)
    got = bwd_sm90.launch(variant, prm, plan.pre_grid, q, k, v, dout, 0, 132,
                          (nseq, 650) if varlen else None)
    assert got == variant.name and got.endswith("_det")
    slab = int(before["dq_accum_slab"])
    rows, slabs = (h * s_q, h * nseq) if varlen else (b * h * s_q, b * h)
    assert slab == rows * d
    n_sem = -(-rows // 64) + slabs
    assert allocs == [(slab + n_sem, np.dtype(np.float32))]
    assert memsets == [((1 << 30) + 4 * slab, 0, 4 * n_sem)]
    assert [s[0] for s in seen] == ["pre", "main", "dq"]
    for _, rec in seen:
        assert rec["dq_accum"] == 1 << 30 and rec["deterministic"] == 0 and rec["sched"] == 4096
    # the main kernel's order: plan_bwd_sm90.det_sched of its key tiles, pairs and grid
    num_n, pairs = (-(-650 // 128), h_k * nseq) if varlen else (-(-s_k // 128), h_k * b)
    main_rec = seen[1][1]
    assert main_rec["det_sched"] == plan_bwd_sm90.det_sched(num_n, pairs, min(132, num_n * pairs))
    assert main_rec["det_sched"] & 1 and main_rec["det_sched"] >> 1 >= 1
    assert all(prm[f].tobytes() == before[f].tobytes() for f in prm.dtype.names)   # untouched
