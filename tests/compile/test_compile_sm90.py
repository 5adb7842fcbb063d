"""NVRTC compile harness for the Hopper kernels (kernels_cu/hopper/fwd.cu, hopper/bwd.cu,
hopper/dbias.cu, ...), sm_90a.

Every variant of plan_fwd_sm90.variants() and plan_bwd_sm90.variants() compiles without a GPU (NVRTC
only), with no register spills (a few bytes allowed in some bias forward variants) and no
ptxas warning (a "wgmma ... serialized" warning would mean the products run one at a time). The
entry register count is the launch cap (168 for 384 threads, 128 for 512); setmaxnreg then moves
registers from the producer warpgroup to the consumers.
"""
from __future__ import annotations

import pytest

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
pytestmark = pytest.mark.all_variants   # the sweep; test_compile_families.py compiles one of each

from cupyflash.gpu import compile as gpu_compile, plan_bwd_sm90, plan_dbias_sm90, plan_fwd_sm90  # noqa: E402
from targets import HOPPER, print_report  # noqa: E402


@pytest.fixture(scope="module")
def reports():
    jobs = []
    vs = plan_fwd_sm90.variants()
    for elem in ("f16_t", "bf16_t"):
        for window in (False, True):
            chunk = [v for v in vs if v.elem == elem and v.window == window]
            jobs.append((HOPPER, chunk, "hopper/fwd.cu"))
    res = gpu_compile.nvrtc_reports(jobs)[HOPPER]
    print_report(f"{HOPPER}: registers / spill bytes per Hopper variant", vs, res)
    return res


#: Spill bytes allowed: none, except a few in the float32-bias variants (ptxas spills 12 B of
#: the hd 128 one under NVRTC 12.9 whatever the order of its loads; docs/hopper.md) and in the
#: 16-bit bias variants that hold the next key tile's bias in registers (BIAS_REGS: 12 B at
#: hd 128, and still 5-9% faster on the H200 than without them).
def _spill_budget(v):
    # hd 128 with window, softcap and a float32 bias: since O is staged for the TMA store, ptxas
    # keeps 64 bytes of per-block values on the stack, stored once and reloaded once per work
    # tile (before its first S; nothing in the key-tile loop), NVRTC / nvcc 13
    if v.bias == 2 and v.softcap and v.window and v.d == 128:
        return 72
    # a bias without a band: up to 16 B (hd 128; with softcap, since the epilogue is TMA-only, a
    # Q descriptor spilled at the first S of each work tile, outside the key-tile loop); 24 B for
    # softcap + 16-bit bias since the softmax runs beside P V (SOFTMAX_BESIDE_PV: 20 B under NVRTC
    # 12.9, stored before a work tile's first S and reloaded after its epilogue, nvcc 13 SASS)
    if v.bias == 1 and v.softcap and not v.window:
        return 24
    return 16 if v.bias == 2 or (v.bias == 1 and not v.window) else 0


def test_every_variant_compiles_without_spills(reports):
    vs = plan_fwd_sm90.variants()
    assert set(reports) == {v.name_expression for v in vs}
    bad = _over_budget(vs, reports, _spill_budget)
    assert not bad, "\n".join(bad)


def test_register_pool_covers_setmaxnreg(reports):
    """setmaxnreg.inc takes only registers the block's own warps gave back, so a block's launch
    pool (entry registers x threads) must hold producer·128 + consumer·128·NC of
    hopper/fwd_layout.cuh's Regs (else every consumer hangs at regs_acquire), and the
    blocks_per_sm blocks' pools must fit in the SM's 64K registers."""
    import re
    src = (gpu_compile.kernels_dir() / "hopper" / "fwd_layout.cuh").read_text()
    regs = {(int(nc), int(blocks or 1)): (int(p), int(c)) for nc, blocks, p, c in re.findall(
        r"struct Regs<(\d)(?:, (\d))?> \{ static constexpr int PRODUCER = (\d+), CONSUMER = (\d+); \}",
        src)}
    assert set(regs) == {(1, 2), (1, 3), (2, 1), (3, 1)}
    bad = []
    for v in plan_fwd_sm90.variants():
        entry = reports[v.name_expression][0]
        producer, consumer = regs[(v.nc, v.blocks_per_sm)]
        if entry * v.threads < 128 * (producer + consumer * v.nc) or \
                entry * v.threads * v.blocks_per_sm > 65536:
            bad.append(f"{v.name}: {entry} entry registers x {v.threads} threads, "
                       f"{v.blocks_per_sm} blocks, Regs {producer} / {consumer}")
    assert not bad, "\n".join(bad)


def _ptxas_warnings(parts, filename):
    """ptxas warning lines of one NVRTC program (source, options, name expressions) for sm_90a."""
    src, opts, names = parts
    prog = nvrtc.createProgram(src, filename, [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        nvrtc.compileProgram(prog, [o for o in opts if not o.startswith("-arch")]
                             + [f"-arch={HOPPER}", "--ptxas-options=-v"])
        log = nvrtc.getProgramLog(prog).replace("\0", "")
    finally:
        nvrtc.destroyProgram(prog)
    return [ln for ln in log.splitlines() if "warning" in ln.lower()]


def _per_elem_report(title, vs, filename, elems=("f16_t", "bf16_t")):
    """NVRTC reports {name expression: (registers, spill bytes)} of variants ``vs`` (one program
    per element type), printed under ``title``; asserts every variant got one."""
    jobs = [(HOPPER, [v for v in vs if v.elem == e], filename) for e in elems]
    res = gpu_compile.nvrtc_reports(jobs)[HOPPER]
    print_report(f"{HOPPER}: registers / spill bytes per {title}", vs, res)
    assert {v.name_expression for v in vs} <= set(res)
    return res


def _over_budget(vs, res, budget=lambda v: 0):
    """'name: (registers, spills)' of each variant spilling more than ``budget(v)`` bytes."""
    return [f"{v.name}: {res[v.name_expression]}" for v in vs
            if res[v.name_expression][1] > budget(v)]


def test_no_ptxas_warnings():
    """ptxas warns when wgmma products get serialized or setmaxnreg is ignored: fail on any."""
    v = plan_fwd_sm90.Sm90Variant("bf16_t", 128, 128, 2, True, True)
    warnings = _ptxas_warnings(gpu_compile.program([v]), "hopper/fwd.cu")
    assert not warnings, "\n".join(warnings)


def test_float32_variants_compile_without_spills():
    """The float32 forward (hopper/fwd_f32.cu, plan_fwd_sm90.f32_variants()): 0 spills, and no ptxas
    warning in any of them (one program per element type)."""
    vs = plan_fwd_sm90.f32_variants()
    res = _per_elem_report("float32 Hopper variant", vs, "hopper/fwd_f32.cu",
                           plan_fwd_sm90.F32_ELEMS)
    bad = _over_budget(vs, res)
    assert not bad, "\n".join(bad)
    warnings = _ptxas_warnings(gpu_compile.program(vs), "hopper/fwd_f32.cu")
    assert not warnings, "\n".join(warnings)


def test_backward_variants_compile_without_spills():
    vs = plan_bwd_sm90.variants()
    res = _per_elem_report("Hopper backward variant", vs, "hopper/bwd.cu")
    bad = _over_budget(vs, res, _bwd_spill_budget)
    assert not bad, "\n".join(bad)


#: Backward spill bytes allowed: none, except the hd 128 variants whose consumers load the bias
#: from global memory (BIAS_LD16 / BIAS_LD32: dK, dV, Sᵀ and dPᵀ take 192 of the consumers' 232
#: registers; the bias addresses and the dbias pairs spill 8-64 B under NVRTC 12.9 even with dPᵀ
#: issued after Pᵀ; docs/hopper.md). BIAS_TMA (the bias read from shared memory) spills nothing.
#: Head dim 256 with varlen: 8 B (window) or 16 B (deterministic) in the TMA thread (40
#: registers; NVRTC 12.9) around its four-panel K / V and Q / dO loads, stored and reloaded by
#: that one thread (an L1 hit beside a step's 64 KB of TMA loads); nothing in the consumers.
def _bwd_spill_budget(v):
    if v.d == plan_bwd_sm90.SPLIT_D and v.varlen:
        return 16
    return 64 if v.bias in (plan_bwd_sm90.BIAS_LD16, plan_bwd_sm90.BIAS_LD32) and v.d == 128 else 0


def test_backward_bias_and_varlen_variants_no_ptxas_warnings():
    """No wgmma serialization (or other) ptxas warning in the BIAS and VARLEN backward variants."""
    for v in [x for x in plan_bwd_sm90.variants() if (x.bias or x.varlen) and x.elem == "bf16_t"]:
        warnings = _ptxas_warnings(gpu_compile.program([v]), "hopper/bwd.cu")
        assert not warnings, v.name + ": " + "\n".join(warnings)


def test_float32_backward_compiles_without_spills():
    """The float32 Hopper backward (hopper/bwd_f32.cu, plan_bwd_sm90_f32.variants()):
    0 spills and no ptxas warning in its variants and helper kernels."""
    from cupyflash.gpu import plan_bwd_sm90_f32

    vs = plan_bwd_sm90_f32.variants()
    res = gpu_compile.nvrtc_reports([(HOPPER, vs, "hopper/bwd_f32.cu")])[HOPPER]
    print(f"\n{HOPPER}: registers / spill bytes per float32 Hopper backward variant")
    for n, (regs, spill) in sorted(res.items()):
        print(f"  {n:55s} {regs:4d} regs {spill:6d} B spill")
    assert {v.name_expression for v in vs} <= set(res)
    bad = [f"{n}: {r}" for n, r in res.items() if r[1] > 0]
    assert not bad, "\n".join(bad)
    warnings = _ptxas_warnings(gpu_compile.program(vs), "hopper/bwd_f32.cu")
    assert not warnings, "\n".join(warnings)


def test_dbias_kernel_compiles_without_spills():
    """The Hopper dbias kernel (hopper/dbias.cu, plan_dbias_sm90.variants()): every variant 0 spills
    and no ptxas warning (no serialized wgmma; one program per element type)."""
    vs = plan_dbias_sm90.variants()
    res = _per_elem_report("Hopper dbias variant", vs, "hopper/dbias.cu")
    bad = _over_budget(vs, res)
    assert not bad, "\n".join(bad)
    # setmaxnreg.inc waits until the CTA's register pool (entry count x 384 threads, allocated at
    # launch) can give the consumers 232: 40·128 + 232·256 = 64512 = 168·384. An entry count
    # below 168 would hang every consumer at regs_acquire on the device, so check it here.
    low = [f"{v.name}: {res[v.name_expression][0]} entry registers" for v in vs
           if res[v.name_expression][0] * plan_dbias_sm90.THREADS < 40 * 128 + 232 * 256]
    assert not low, "\n".join(low)
    for e in ("f16_t", "bf16_t"):
        warnings = _ptxas_warnings(gpu_compile.program([v for v in vs if v.elem == e]),
                                   "hopper/dbias.cu")
        assert not warnings, "\n".join(warnings)
