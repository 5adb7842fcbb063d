# Question: Shared by the A/B scripts: how to time candidates so that clock and temperature drift hits each alike (interleaved rounds, medians)?
"""Interleaved A/B timing shared by lab/ab_fwd_kernels.py, ab_bwd_f32.py and
ab_bwd_f32_pkgs.py: every round times each candidate once, then the peer, so drift in clocks or
temperature hits all of them alike; medians over rounds. No cupyflash import: ab_bwd_f32_pkgs
loads several copies of the package and passes one's ``time_ms``."""
from __future__ import annotations

import math
import statistics


def interleaved_tflops(calls, peer, flops, rounds, rep, time_ms):
    """(median TFLOP/s of each call, of the peer or nan without one): ``time_ms(fn, warmup, rep)``
    per call and round; ``flops`` the work of one call."""
    times, t_peer = [[] for _ in calls], []
    for _ in range(rounds):
        for i, call in enumerate(calls):
            times[i].append(time_ms(call, warmup=2, rep=rep))
        if peer is not None:
            t_peer.append(time_ms(peer, warmup=2, rep=rep))
    tf = [flops / statistics.median(t) / 1e9 for t in times]
    return tf, (flops / statistics.median(t_peer) / 1e9 if t_peer else math.nan)


def tflops_columns(tf, t_peer) -> str:
    """'tf_0 .. tf_n peer | tf_1/tf_0 .. tf_n/tf_0 tf_n/peer' as the A/B scripts print them."""
    return (" ".join(f"{x:7.1f}" for x in tf) + f" {t_peer:7.1f} | "
            + " ".join(f"{x / tf[0]:7.3f}" for x in tf[1:]) + f" {tf[-1] / t_peer:7.2f}")
