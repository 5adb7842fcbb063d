# Question: How do the bias / varlen timings move when one tuning switch is flipped?
"""A/B helper: bench_bias_varlen.py with switches of cupyflash.gpu.tuning.TUNING set first.

    python lab/ab_switch.py HOPPER_SCHED_B=0 [DBIAS_KERNEL=1 ...] -- [bench_bias_varlen args]

Switches: ``HOPPER_SCHED_B`` (the Hopper backward's batch-fastest dbias schedule,
DBIAS_SCHED_B), ``DBIAS_KERNEL`` (1: dbias from a dbias kernel wherever eligible, 0: never;
unset: plan_bwd.use_dbias_kernel decides), ``DBIAS_SM90`` (1: that
dbias kernel is flash_bwd_dbias_sm90 on compute capability 9.0 where it covers the call, the
default; 0: always flash_bwd_dbias). Each NAME=0|1 must name an existing switch."""
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cupyflash.gpu.tuning import TUNING  # noqa: E402

args = sys.argv[1:]
cut = args.index("--") if "--" in args else len(args)
for item in args[:cut]:
    name, _, value = item.partition("=")
    if name not in ("HOPPER_SCHED_B", "DBIAS_KERNEL", "DBIAS_SM90") or value not in ("0", "1"):
        raise SystemExit(f"ab_switch.py: {item!r}: expected HOPPER_SCHED_B=0|1, DBIAS_KERNEL=0|1 "
                         "or DBIAS_SM90=0|1")
    setattr(TUNING, name.lower(), value == "1")   # the switches of gpu.tuning.TUNING
sys.argv = [str(Path(__file__).with_name("bench_bias_varlen.py"))] + args[cut + 1:]
runpy.run_path(sys.argv[0], run_name="__main__")
