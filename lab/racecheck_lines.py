"""Which source lines race? Runs tests/gpu/kernel_families.py cases with the kernels compiled
with -lineinfo, so compute-sanitizer's racecheck reports name kernels_cu/ file:line pairs.

    compute-sanitizer --tool racecheck --racecheck-report hazard \
        python lab/racecheck_lines.py --alloc exact sm90_f32_d128_window
"""
import runpy
import sys
from pathlib import Path

import cupyflash.gpu.compile as _compile

_base = _compile.base_options
_compile.base_options = lambda: _base() + ("-lineinfo",)
sys.argv = [str(Path(__file__).resolve().parents[1] / "tests/gpu/kernel_families.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
