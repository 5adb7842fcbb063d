"""What every kernel family shares: the variant base class, element tags, head-dim buckets,
shared-memory classes, the dtype names the launchers accept, and the checks every Hopper kernel
makes. Pure Python (NumPy, ml_dtypes).

A *variant* is one template instantiation of one kernel entry. Every family's variant class is a
frozen dataclass on ``KernelVariant``: its fields are the template parameters, ``template`` the
entry's name, ``template_args()`` the C++ template arguments in order, ``file`` the kernels_cu/
source that defines it, ``arch_options`` the NVRTC target it needs, ``helper_expressions`` the
helper kernels compiled into the same module. ``compile.program`` turns a list of variants of one
class into NVRTC's input.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np

from .tma import tma_strides_ok


@dataclass(frozen=True)
class KernelVariant:
    """One template instantiation of a kernel entry (subclasses add the fields: the template
    parameters, and ``name``, ``threads``, ``smem_bytes``)."""

    #: the kernel entry's C++ name (e.g. "flash_fwd")
    template: ClassVar[str]
    #: the source file in kernels_cu/ that defines the entry
    file: ClassVar[str]
    #: NVRTC options naming the target it needs ("-arch=sm_90a" for wgmma / setmaxnreg; empty:
    #: CuPy's -arch for the device)
    arch_options: ClassVar[tuple] = ()
    #: name expressions of helper kernels compiled into the same module (a property where they
    #: depend on the fields)
    helper_expressions: ClassVar[tuple] = ()

    def template_args(self) -> tuple:
        """The C++ template arguments, in order, as strings."""
        raise NotImplementedError

    @property
    def name_expression(self) -> str:
        """The instantiation's C++ name, as NVRTC's name expression."""
        return f"{self.template}<{', '.join(self.template_args())}>"

    def replace(self, **changes):
        """A copy with ``changes`` to the fields."""
        return dataclasses.replace(self, **changes)


#: Head-dim buckets (multiples of 32: the padded shared-memory rows read conflict-free for each).
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]


#: Element tags by (dtype name, allow_tf32); f64_t: float64 on DMMA (mma.sync m8n8k4 .f64),
#: double accumulators, statistics and lse (portable kernels only).
ELEMS = ("f16_t", "bf16_t", "f32x3_t", "tf32_t", "f64_t")
ELEM_SIZE = {"f16_t": 2, "bf16_t": 2, "f32x3_t": 4, "tf32_t": 4, "f64_t": 8}
#: Bytes of the accumulator type (lse, D, the dQ / dbias accumulators, ALiBi slopes) per tag
ACC_SIZE = {e: 8 if ELEM_SIZE[e] == 8 else 4 for e in ELEMS}


#: Opt-in shared memory per block at or above which the "big" tile table is used (sm_80, sm_87,
#: sm_90, sm_100: 163-227 KB); below it (sm_86, sm_89, sm_120: 99 KB) the "small" one.
BIG_SMEM = 160 * 1024


#: Dynamic shared memory per block on compute capability 9.0 (opt-in; H100 / H200), sm90::SMEM_MAX
#: in hopper/fwd.cu; the default device limit of the planners (precompile, CPU tests)
SM90_SMEM_MAX = 227 * 1024


def cpp_bool(x) -> str:
    """A C++ template argument for a flag: "true" / "false" (name expressions)."""
    return "true" if x else "false"


def smem_class(smem_optin: int) -> str:
    return "big" if smem_optin >= BIG_SMEM else "small"


def head_dim_bucket(d: int, d_v: int) -> int:
    need = max(d, d_v)
    for bkt in HEAD_DIM_BUCKETS:
        if need <= bkt:
            return bkt
    raise NotImplementedError(
        f"head_dim {d} / head_dim_v {d_v}: the GPU forward kernel covers head dims up to "
        f"{MAX_HEAD_DIM}")


def elem_tag(dtype_name: str, allow_tf32: bool) -> str:
    if dtype_name == "float16":
        return "f16_t"
    if dtype_name == "bfloat16":
        return "bf16_t"
    if dtype_name == "float32":
        return "tf32_t" if allow_tf32 else "f32x3_t"
    if dtype_name == "float64":
        return "f64_t"
    raise NotImplementedError(
        f"dtype {dtype_name}: the GPU kernels take float16, bfloat16, float32 or float64")


try:  # ml_dtypes supplies bfloat16 for NumPy / CuPy
    import ml_dtypes
    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    _BF16 = None

#: The dtypes the GPU kernels take, by name

DTYPE_NAMES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
               np.dtype(np.float64): "float64"}

if _BF16 is not None:
    DTYPE_NAMES[_BF16] = "bfloat16"


def sm90_common_unsupported(dtype_name: str, d: int, d_v: int, head_dims, *, cc: int,
                            smem_need: int, smem_optin: int, tensors=(),
                            dtypes=("float16", "bfloat16")) -> Optional[str]:
    """The checks every Hopper kernel (forward, backward) makes: compute capability 9.0,
    a dtype in ``dtypes``, d = d_v in ``head_dims``, shared memory, strides TMA accepts for each
    (shape, element strides) in ``tensors``. None when they pass, else the reason."""
    if cc != 90:
        return f"compute capability {cc / 10:.1f} (the Hopper kernel needs 9.0)"
    if dtype_name not in dtypes:
        return f"dtype {dtype_name} (the Hopper kernel takes {' / '.join(dtypes)})"
    if d != d_v or d not in head_dims:
        return f"head dims {d} / {d_v} (the Hopper kernel takes d = d_v in {tuple(head_dims)})"
    if smem_need > smem_optin:
        return f"shared memory {smem_optin} bytes"
    itemsize = 4 if dtype_name == "float32" else 2
    for shape, strides in tensors:
        if not tma_strides_ok(shape, strides, itemsize):
            return f"strides {tuple(strides)} of a {tuple(shape)} tensor (TMA needs 16-byte multiples)"
    return None
