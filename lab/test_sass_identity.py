# Question: Does sass_identity.py's normalization drop only layout noise, never a code difference?
"""lab/sass_identity.py: its normalization of nvdisasm text (no GPU, no compile)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sass_identity  # noqa: E402

SASS = """\t.headerflags\t@"EF_CUDA_SM90"
//--------------------- .text.{k} --------------------------
\t.section\t.text.{k},"ax",@progbits
\t.size\t{k},(.L_x_{a} - {k})
        /*0000*/                   ISETP.GE.AND P0, PT, R0, 0x{n}, PT ;
.L_x_{b}:
        /*0010*/               @P0 BRA `(.L_x_{b}) ;
\t.section\t.nv.constant4,"a",@progbits
        /*0118*/ \t.dword\t_ZN48_INTERNAL_00000000_11_fwd_sm90_cu_{h}4sm907WG_ROWSE
"""


def sections(a=7, b=3, n=1, h="67f91ab7_18909"):
    return sass_identity.split_functions(SASS.format(k="_Z1kv", a=a, b=b, n=n, h=h))


def test_label_numbers_and_file_hashes_are_not_differences():
    assert sections() == sections(a=90, b=12, h="bd2384b8_22770")


def test_an_instruction_change_is_a_difference():
    base, other = sections(), sections(n=2)
    assert base[".text._Z1kv"] != other[".text._Z1kv"]
    assert base[".nv.constant4"] == other[".nv.constant4"]


def test_label_order_is_kept():
    # two labels swapped in use order stay distinct after renumbering
    a = sass_identity._renumber_labels("BRA .L_x_1 ; BRA .L_x_2 ; .L_x_1: ; .L_x_2:")
    b = sass_identity._renumber_labels("BRA .L_x_1 ; BRA .L_x_2 ; .L_x_2: ; .L_x_1:")
    assert a != b


def test_internal_names_keep_what_follows():
    t = "x _ZN48_INTERNAL_00000000_11_fwd_sm90_cu_67f91ab7_189094sm908TURN_BARE y"
    assert sass_identity._internal_names(t) == "x _ZN#INTERNAL#4sm908TURN_BARE y"
