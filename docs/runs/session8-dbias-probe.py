"""Where flash_bwd_dbias spends its time: the kernel alone with parts removed (source edits,
probe only), other tiles; the main backward without it; the old path. bias (1,16,s,s) bf16 hd128."""
import sys, statistics
import cupy as cp, numpy as np, ml_dtypes
from cupyflash import _checks, _gpu, _gpu_bwd, _modules
BF16 = np.dtype(ml_dtypes.bfloat16)
H, D = 16, 128
rng = np.random.default_rng(0)
def rnd(shape): return cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(BF16))
def tm(fn, w=2, r=7):
    for _ in range(w): fn()
    ts = []
    for _ in range(r):
        a, b = cp.cuda.Event(), cp.cuda.Event(); a.record(); fn(); b.record(); b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b))
    return statistics.median(ts)
SRC = open("kernels_cu/bwd.cu").read()
EDITS = {"base": []}
def kernel(edit, bm=64, bn=64, nbuf=1):
    src = SRC
    for a, b in EDITS[edit]:
        assert src.count(a) == 1, (edit, a); src = src.replace(a, b)
    name = f"flash_bwd_dbias<bf16_t, {D}, {bm}, {bn}, {nbuf}>"
    mod = cp.RawModule(code=src, options=_modules.base_options(), name_expressions=[name])
    fn = mod.get_function(name)
    v = _gpu_bwd.DbiasVariant("bf16_t", D, bm, bn, nbuf)
    fn.max_dynamic_shared_size_bytes = v.smem_bytes
    return fn, v
for s in (int(x) for x in sys.argv[1:]):
    b = 16384 // s
    q, k, v, dout = (rnd((b, s, H, D)) for _ in range(4))
    bias = rnd((1, H, s, s))
    opts = _checks.make_options(_checks.check_qkv(q, k, v), cp, bias=bias)
    out = cp.empty_like(q); lse = cp.empty((b, H, s), cp.float32)
    _gpu.forward(q, k, v, out, lse, opts)
    grads = [cp.empty_like(x) for x in (q, k, v)]; dbias = cp.empty(bias.shape, BF16)
    cap = {}
    orig = _gpu_bwd._fill_and_launch
    def spy(*a, **kw):
        after = kw.get("after")
        if after is not None:
            def keep(rec):
                cap["prm"] = np.array(rec)
                if not cap.get("skip"): after(rec)
            kw["after"] = keep
        return orig(*a, **kw)
    _gpu_bwd._fill_and_launch = spy
    bwd = lambda: _gpu_bwd.backward(dout, q, k, v, out, lse, *grads, opts, dbias=dbias)
    t_new = tm(bwd)
    cap["skip"] = True; t_main = tm(bwd); cap["skip"] = False
    _gpu_bwd.DBIAS_KERNEL = False; t_old = tm(bwd); _gpu_bwd.DBIAS_KERNEL = True
    _gpu_bwd._fill_and_launch = orig
    dsum = cp.empty(b * H * s, cp.float32)
    prm = cap["prm"].copy(); prm["dsum"] = dsum.data.ptr
    fl = 2 * 2.0 * b * H * s * s * D
    print(f"s {s} b {b}: backward new {t_new:.3f} ms, main kernels only {t_main:.3f}, old path {t_old:.3f}")
    for edit, bm, bn, nbuf in (("base", 128, 64, 2), ("base", 64, 64, 1), ("base", 64, 64, 2), ("base", 128, 64, 1), ("base", 128, 32, 2)):
        try:
            fn, var = kernel(edit, bm, bn, nbuf)
        except Exception as e:
            print(f"  {edit} {bm}x{bn}: {type(e).__name__} {str(e)[:200]}"); continue
        for nob in (False,):
            if nob and edit != "base": continue
            pr = prm.copy()
            if nob: pr["bias"] = 0
            rec = pr.reshape(1)[0]
            grid = (-(-s // bn), -(-s // bm), H)
            t = tm(lambda: fn(grid, (var.threads, 1, 1), (rec,), shared_mem=var.smem_bytes))
            print(f"  dbias kernel {edit:8s} {bm}x{bn} nbuf {nbuf}{' no bias read' if nob else ''}: {t:.3f} ms ({fl / t / 1e9:.1f} TFLOP/s)")
    del q, k, v, dout, bias, out, lse, grads, dbias
    cp.get_default_memory_pool().free_all_blocks()
