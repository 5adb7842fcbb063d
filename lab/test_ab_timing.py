# Question: Do the A/B scripts' interleaving, medians and columns behave (CPU only)?
"""lab/ab_timing.py (the A/B scripts' shared timing): interleaving, medians, columns."""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_timing import interleaved_tflops, tflops_columns  # noqa: E402


def test_rounds_interleave_candidates_then_peer_and_take_medians():
    order = []
    ms = {"a": iter([4.0, 1.0, 2.0]), "b": iter([8.0, 8.0, 1.0]), "peer": iter([5.0, 5.0, 20.0])}

    def make(name):
        def fn():
            pass
        fn.__name__ = name
        return fn

    def time_ms(fn, warmup, rep):
        assert (warmup, rep) == (2, 7)
        order.append(fn.__name__)
        return next(ms[fn.__name__])

    tf, t_peer = interleaved_tflops([make("a"), make("b")], make("peer"), 2e12, 3, 7, time_ms)
    assert order == ["a", "b", "peer"] * 3
    assert tf == [2e12 / 2.0 / 1e9, 2e12 / 8.0 / 1e9] and t_peer == 2e12 / 5.0 / 1e9


def test_without_a_peer_and_the_printed_columns():
    tf, t_peer = interleaved_tflops([lambda: None], None, 1e12, 2, 1, lambda fn, warmup, rep: 2.0)
    assert tf == [500.0] and math.isnan(t_peer)
    assert tflops_columns([100.0, 150.0], 50.0) == "  100.0   150.0    50.0 |   1.500    3.00"
