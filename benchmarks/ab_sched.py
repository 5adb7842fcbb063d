"""A/B helper: bench_bias_varlen.py with the Hopper backward's batch-fastest dbias schedule
(DBIAS_SCHED_B) switched off (``_gpu_bwd.HOPPER_SCHED_B = False``); same arguments."""
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cupyflash import _gpu_bwd  # noqa: E402

_gpu_bwd.HOPPER_SCHED_B = False
sys.argv = [str(Path(__file__).with_name("bench_bias_varlen.py"))] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
