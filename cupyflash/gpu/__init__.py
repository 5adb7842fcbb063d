"""The GPU side of cupyflash: planners (pure Python), the compile path, and the launchers.

Layers, each importing only from the ones below it (tests/unit/test_imports.py checks that the
package's imports have no cycle)::

    fwd, bwd                   dispatchers: which kernel runs a call, workspaces, dbias reduction
    fwd_portable, fwd_sm90,    launchers, one per kernel family (CuPy)
    bwd_sm90, bwd_sm90_f32,
    dbias_sm90
    device, operands           device queries and per-stream buffers; bias / mask / ALiBi operands
    plan_fwd, plan_fwd_sm90,   planners (pure Python): variants, why a call is not covered, tiles,
    plan_bwd, plan_bwd_sm90,   grids, Params sizes
    plan_bwd_sm90_f32,
    plan_dbias_sm90
    compile                    kernels_cu/ sources -> NVRTC -> one locked cache of compiled kernels
    variants, tuning           the shared variant definition; the tuning switches
    tma, params                CUtensorMap descriptors; the Params record

This file imports nothing: the planners (``cupyflash.gpu.plan_*``) run without CuPy, and only the
launchers (fwd, bwd and what they import) need it. docs/architecture.md describes the layout.
"""
