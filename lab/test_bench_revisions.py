"""CPU test of lab/bench_revisions.py's comparison (no GPU: synthetic bench JSONs)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_revisions  # noqa: E402


def _json(path, rows):
    with open(path, "w") as f:
        json.dump({"device": "test", "rows": [
            dict(head_dim=d, seqlen=s, causal=c, direction=dr, tflops=dict(cupyflash=cf, cudnn=cu))
            for d, s, c, dr, cf, cu in rows]}, f)
    return str(path)


def test_worst_quotient_is_the_lowest_cell_of_the_medians(tmp_path, capsys):
    old = [_json(tmp_path / f"old{i}.json", [(64, 1024, False, "fwd", 100, 100),
                                             (64, 1024, True, "bwd", 90, 100)]) for i in (1, 2)]
    new = [_json(tmp_path / "new1.json", [(64, 1024, False, "fwd", 105, 100),
                                          (64, 1024, True, "bwd", 81, 100)]),
           _json(tmp_path / "new2.json", [(64, 1024, False, "fwd", 103, 100),
                                          (64, 1024, True, "bwd", 85, 100)])]
    worst = bench_revisions.compare(bench_revisions.ratios(old, "cudnn"),
                                    bench_revisions.ratios(new, "cudnn"), "cudnn")
    assert abs(worst - 0.83 / 0.90) < 1e-12   # median of 0.81, 0.85 over 0.90
    assert "worst new / old: 0.922" in capsys.readouterr().out
