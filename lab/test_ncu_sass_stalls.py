# Question: Does ncu_sass_stalls.py read Nsight Compute's source page (a synthetic page, CPU only)?
"""lab/ncu_sass_stalls.py reads Nsight Compute's source page (CPU only, a synthetic page)."""
from __future__ import annotations

import gzip
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ncu_sass_stalls as nss  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_barrier", "stall_wait", "stall_barrier (Not Issued)"]
ROWS = [
    ["0x7f00a0", "  HGMMA.64x128x16.F32.BF16 R88, gdesc[UR20], R88", "30", "20", "300", "0", "30", "0"],
    ["0x7f00b0", "  WARPGROUP.DEPBAR.LE gsb0, 0x0", "60", "55", "100", "58", "2", "55"],
    ["0x7f00c0", "  MUFU.EX2 R88, R88", "10", "5", "300", "0", "10", "0"],
]


@pytest.fixture(params=["plain", "gz"], ids=["csv", "csv.gz"])
def page(tmp_path, request):
    lines = ['"Kernel Name","void k(Params)",'] + [",".join(f'"{x}"' for x in r) for r in [HEADER] + ROWS]
    text = "\n".join(lines) + "\n"
    if request.param == "gz":
        p = tmp_path / "page.csv.gz"
        p.write_bytes(gzip.compress(text.encode()))
    else:
        p = tmp_path / "page.csv"
        p.write_text(text)
    return str(p)


def test_summary_ranks_reasons_and_instructions(page):
    kernel, rows = nss.read_page(page)
    assert kernel == "void k(Params)" and len(rows) == 3
    out = nss.summary(rows, top=2)
    assert out[0] == "total samples 100"
    assert out[1].split()[:2] == ["barrier", "58"] and out[2].split()[:2] == ["wait", "42"]
    tops = [line for line in out if line.startswith("f00")]
    assert [t.split()[0] for t in tops] == ["f00b0", "f00a0"]          # by samples, the top two
    assert "DEPBAR" in tops[0] and "barrier:58" in tops[0]


def test_span_keeps_the_address_range(page):
    _, rows = nss.read_page(page)
    out = nss.span(rows, 0xF00B0, 0xF00C0)
    assert [line.split()[0] for line in out] == ["f00b0", "f00c0"]
    assert nss.main([page, "--range", "f00a0", "f00a0"]) == 0


def test_by_count_groups_by_execution_count(page):
    _, rows = nss.read_page(page)
    out = nss.by_count(rows)
    assert out[0] == "total samples 100"
    # the once-per-tile DEPBAR (60 samples, 100 executions) first, then the two loop instructions
    assert out[1].split()[:6] == ["executed", "100", "instructions", "1", "samples", "60"]
    assert out[2].split()[:6] == ["executed", "300", "instructions", "2", "samples", "40"]
    assert "wait:40" in out[2]
    assert nss.main([page, "--by-count"]) == 0
