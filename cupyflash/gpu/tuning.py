"""The planners' tuning switches, in one object.

Each field is a choice the planners make the same way on every call and that measurements
decided; tests and A/B benchmarks flip them to run or time the alternative. Read at plan or launch
time (never cached), so a change applies to the next call::

    from cupyflash.gpu.tuning import TUNING, tuning

    with tuning(dbias_kernel=True, dbias_sm90=False):   # restored on exit
        cupyflash.attention_backward(...)

``TUNING`` is process-wide (not per thread). Pure Python.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass
class Tuning:
    """The switches (defaults: what the planners do)."""

    #: kernel="auto" runs float32 forwards on the Hopper kernel (hopper/fwd_f32.cu) where it covers
    #: the call. On the H200: 52 of its 53 GPU tests passed (the 53rd, s_k = 4096, is the float32
    #: error growth both kernels share: docs/hopper.md, "Float32 forward"), its errors equal the
    #: portable kernel's at s_k = 256 .. 16k, and it ran 73-97 TFLOP/s against the portable
    #: kernel's 20-29. False: float32 runs the portable kernel under "auto".
    sm90_float32_auto: bool = True

    #: The Hopper forward planner's variant (kernel="auto") splits the grid's last partial wave
    #: along the keys where plan_fwd_sm90.sm90_split's model gains. False: never (benchmarks switch
    #: it to time both).
    sm90_split_auto: bool = True

    #: The Hopper backward's dbias: work tiles batch-fastest where dbias sums over the batch
    #: (plan_bwd.DBIAS_SCHED_B, set by plan_bwd.hopper_dbias_mode). False: the default order.
    hopper_sched_b: bool = True

    #: The dbias-kernel path where a call is eligible (plan_bwd.dbias_by_kernel): None lets
    #: plan_bwd.use_dbias_kernel decide (the Hopper dbias kernel covers the call, deterministic
    #: mode, or the float32 accumulator does not fit); True / False force it either way.
    dbias_kernel: Optional[bool] = None

    #: Where that dbias kernel runs: on compute capability 9.0 the Hopper one
    #: (flash_bwd_dbias_sm90, dbias_sm90.py) wherever it covers the call. False: always the
    #: portable flash_bwd_dbias.
    dbias_sm90: bool = True

    #: The deterministic Hopper backward (flash_bwd_sm90<..., DET>): True adds the key tiles' dQ
    #: parts into each dQ tile in descending key-tile order, drawn longest-last, with ascending
    #: query tiles: under causal / right-bounded bands the tile that adds first then reaches each
    #: dQ tile two steps ahead of the next (FlashAttention 3's order). False: ascending, query
    #: tiles descending. None: plan_bwd_sm90.det_order decides (descending below
    #: DET_ASCENDING_FROM key tiles per sequence, ascending with one pair per draw group from
    #: there). plan_bwd_sm90.det_sched.
    det_descending: Optional[bool] = None

    #: (kv head, batch) pairs per draw group of that backward (plan_bwd_sm90.det_sched); None:
    #: plan_bwd_sm90.det_order decides.
    det_group: Optional[int] = None

    #: The portable backward's main kernel for 16-bit calls without bias / mask / varlen at head
    #: dims up to 128 (big shared-memory class): flash_bwd_2d (FlashAttention-2's 2-D warp tiles,
    #: P and dS through shared memory; plan_bwd.variant_2d). False: flash_bwd (16-key slabs per
    #: warp, the transposed products) as for every other call.
    portable_bwd_2d: bool = True

    #: kernel="auto" runs 16-bit backwards at head dim 256 on the Hopper kernel (flash_bwd_sm90's
    #: split-head-dim consumers, hopper/bwd_split_consumer.cuh) where it covers the call: on an
    #: H100, bf16, FlashAttention's shapes (seqlen 512..16k, causal and not), 2.2-2.7x the
    #: portable kernel (126-273 vs 56-105 TFLOP/s). False: the portable kernel under "auto"
    #: (kernel="sm90" runs the Hopper one whatever this says).
    bwd_sm90_d256: bool = True


#: The switches the planners read.
TUNING = Tuning()


@contextlib.contextmanager
def tuning(**changes):
    """Set fields of ``TUNING`` for the ``with`` block, then restore them (unknown names:
    TypeError)."""
    names = {f.name for f in dataclasses.fields(Tuning)}
    unknown = set(changes) - names
    if unknown:
        raise TypeError(f"unknown tuning switches {sorted(unknown)} (known: {sorted(names)})")
    saved = {n: getattr(TUNING, n) for n in changes}
    for n, v in changes.items():
        setattr(TUNING, n, v)
    try:
        yield TUNING
    finally:
        for n, v in saved.items():
            setattr(TUNING, n, v)
