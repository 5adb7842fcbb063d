"""The 16-bit gradient bound of the GPU tests (gpu_util.grad_tolerance), checked on the CPU: it
must admit the stored result's own rounding and still reject a wrong gradient."""
import numpy as np
import pytest

from gpu_util import DTYPES, FLOOR, grad_tolerance, rounding_floor


def test_float16_dbias_case_of_session_14():
    """The dbias check that failed once in 700 draws (CUPYFLASH_SEED=9405552975197041694): the
    kernel's float16 value sits one ulp (0.0625) from the naive one, both next to the reference."""
    rng = np.random.default_rng(5)
    ref = rng.uniform(-8, 8, 400)       # one large element, the rest small (as in that check)
    ref[66] = 120.579
    naive = ref.astype(np.float16).astype(np.float64)
    naive[66] = 120.5625
    got = naive.copy()
    got[66] = 120.625
    n_err, err = np.abs(naive - ref).max(), np.abs(got - ref).max()
    assert err > 2 * n_err + FLOOR["float16"] * 121          # the old bound rejected it
    assert err <= grad_tolerance("float16", ref, n_err)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("scale", [0.01, 1.0, 300.0])
def test_bound_admits_rounding_rejects_wrong(dtype_name, scale):
    rng = np.random.default_rng(11)
    ref = rng.standard_normal((3, 37, 5)) * scale
    stored = ref.astype(DTYPES[dtype_name]).astype(np.float64)
    n_err = np.abs(stored - ref).max()
    tol = grad_tolerance(dtype_name, ref, n_err)
    # the largest element rounded to its other neighbour (one ulp from its correct rounding)
    i = np.unravel_index(np.abs(ref).argmax(), ref.shape)
    mantissa = {"float16": 10, "bfloat16": 7}[dtype_name]
    ulp = 2.0 ** (np.floor(np.log2(abs(stored[i]))) - mantissa)
    off = stored.copy()
    off[i] += ulp if ref[i] > stored[i] else -ulp
    assert np.abs(off - ref).max() <= tol
    # that element 3 % of max(1, max|ref|) off (a lost term of a sum of ~30) fails
    bad = stored.copy()
    bad[i] += 0.03 * max(1.0, abs(ref[i]))
    assert np.abs(bad - ref).max() > tol


def test_floor_is_small():
    ref = np.random.default_rng(2).standard_normal(1000)
    assert rounding_floor("float32", ref) == 0.0
    assert rounding_floor("float16", ref) <= 4 * 2.0 ** -10 * 4   # ~4 ulps of the largest (|x| < 4)
    assert rounding_floor("bfloat16", np.zeros(0)) == 0.0


def test_check_grad_given_out_part():
    """check_grad's given-out allowance (CUPYFLASH_SEED=11078482371635623096: a
    key-only float16 dbias element 14.3984 against 14.3475, naive 14.3516): the part D's stored
    out puts into every backward (model: 14.3937) is allowed element by element, no more."""
    from test_gpu_bias_varlen import check_grad
    ref, given, naive = np.array([14.3475, -2.0]), np.array([14.3937, -2.0]), np.array([14.3516, -2.0])
    check_grad("float16", "dbias", np.array([14.3984, -2.0]), ref, naive, given)
    with pytest.raises(AssertionError, match="err 0.0509"):            # without the allowance
        check_grad("float16", "dbias", np.array([14.3984, -2.0]), ref, naive)
    with pytest.raises(AssertionError, match="beyond the given-out part"):   # off by more
        check_grad("float16", "dbias", np.array([14.45, -2.0]), ref, naive, given)
    with pytest.raises(AssertionError, match="beyond the given-out part"):   # another element
        check_grad("float16", "dbias", np.array([14.3984, -1.9]), ref, naive, given)
