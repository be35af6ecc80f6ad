"""Metric details the hand-computed cases do not reach: the standalone max_abs, zero cases, every stats field."""
import math

import numpy as np
import pytest

from harness.metrics import error_metrics, mae, max_abs, mse, pearson, rel_l2, rmse, sqnr_db, tensor_stats


def test_max_abs_is_the_first_largest_with_its_index():
    ref = np.zeros((2, 3), np.float32)
    test = np.array([[0, -2, 1], [2, 0, 0]], np.float32)
    assert max_abs(ref, test) == (2.0, [0, 1])   # |-2| ties |2|: the first occurrence, negative sign dropped
    assert error_metrics(ref, test)["max_abs_index"] == [0, 1]


def test_zero_reference_and_zero_error():
    zero = np.zeros(4, np.float32)
    assert rel_l2(zero, zero) == 0.0 and sqnr_db(zero, zero) == math.inf
    assert math.isnan(rel_l2(zero, zero + 1)) and sqnr_db(zero, zero + 1) == -math.inf
    assert math.isnan(pearson(np.ones(4, np.float32), np.arange(4, dtype=np.float32)))


def test_metrics_are_computed_in_float64():
    """fp16 inputs: a float16 difference would lose the 1e-4 error entirely."""
    ref = np.full(8, 2048.0, np.float16)
    test = ref.copy()
    test[0] = np.float16(2050.0)
    m = error_metrics(ref, test)
    assert m["max_abs"] == 2.0 and m["mse"] == pytest.approx(4 / 8)
    assert m["sqnr_db"] == pytest.approx(10 * math.log10(8 * 2048.0 ** 2 / 4))


def test_percentiles_interpolate_linearly():
    ref = np.zeros(5, np.float32)
    test = np.array([0, 1, 2, 3, 4], np.float32)
    m = error_metrics(ref, test)
    assert (m["p50"], m["p90"], m["p99"]) == (2.0, pytest.approx(3.6), pytest.approx(3.96))


def test_every_tensor_stats_field():
    v = np.array([[1.0, -3.0], [2.0, 4.0]], np.float32)
    s = tensor_stats(v)
    assert s == {"shape": [2, 2], "dtype": "float32", "kind": "float", "first_10": [1.0, -3.0, 2.0, 4.0],
                 "mean": 1.0, "std": pytest.approx(math.sqrt((0 + 16 + 1 + 9) / 4)), "min": -3.0, "max": 4.0,
                 "l2": pytest.approx(math.sqrt(30)), "nan_count": 0, "inf_count": 0, "quantized": False,
                 "capture_dtype": "float32", "overflow_upper": 0.0, "overflow_lower": 0.0}
    codes = np.array([[1, -128], [2, 127]], np.int8)
    q = tensor_stats(codes.astype(np.float32), codes, 1.0)
    assert q["kind"] == "int8" and q["quantized"] is True and q["clipped_fraction"] is None
    assert q["saturated_fraction"] == 0.5
    many = np.arange(12, dtype=np.float32)
    assert tensor_stats(many)["first_10"] == list(range(10))
    assert tensor_stats(np.ones(1, np.float32), np.ones(1, np.int8), 1.0, 0)["clipped_fraction"] == 0.0


def test_metrics_do_not_depend_on_the_memory_layout():
    """A transposed view and its contiguous copy (what a spilled .npy holds) give the same bits: numpy
    sums in memory order, so without the C-order copy the reference read back from disk moved the
    last bit of mse and rel_l2 (found when the reference arrays went to a spill file)."""
    rng = np.random.default_rng(0)  # a seed where the two orders round differently (checked: seeds 0 and 9 of 0..9)
    base = rng.standard_normal((2, 48, 32)).astype(np.float32)
    ref = base.transpose(0, 2, 1)                       # (2, 32, 48), not C-contiguous
    test = (ref + rng.standard_normal(ref.shape).astype(np.float32) * 1e-3).astype(np.float32)
    test_view = np.ascontiguousarray(test.transpose(0, 2, 1)).transpose(0, 2, 1)
    assert not ref.flags.c_contiguous and not test_view.flags.c_contiguous
    strided = error_metrics(ref, test_view)
    contiguous = error_metrics(np.ascontiguousarray(ref), np.ascontiguousarray(test))
    assert {k: v for k, v in strided.items()} == contiguous


def test_sqnr_is_minus_infinity_when_the_ratio_underflows():
    """Signal and noise both finite and positive, but signal / noise underflows to 0: -inf dB, not +inf
    (a mutant that returned +inf there survived: a drowned signal would have read as a perfect one)."""
    ref = np.array([1e-160, 0.0])      # sum of squares 1e-320 (subnormal, > 0)
    test = np.array([1e150, 0.0])      # noise about 1e300
    assert sqnr_db(ref, test) == -math.inf
    assert error_metrics(ref, test)["sqnr_db"] == -math.inf


def test_overflow_fractions_count_against_the_capture_dtype():
    """stats of an fp16 capture stored as float32 count against fp16's range (65504), not float32's
    (a mutant that dropped source_dtype survived)."""
    v = np.array([70000.0, -70000.0, 1.0, np.inf], np.float32)
    s = tensor_stats(v, source_dtype="float16")
    assert s["capture_dtype"] == "float16"
    assert (s["overflow_upper"], s["overflow_lower"]) == (0.5, 0.25)
    assert (tensor_stats(v)["overflow_upper"], tensor_stats(v)["overflow_lower"]) == (0.25, 0.0)


def test_standalone_metrics_name_both_shapes_on_a_mismatch():
    """The standalone metrics check the shapes themselves (in ``_d``; error_metrics has its own check): a
    ValueError naming both shapes (mutants metrics _d 2, 3, 4: a ValueError(None), or a TypeError from
    list(None) in place of either shape)."""
    ref, test = np.zeros((1, 2, 2), np.float32), np.zeros((1, 2, 3), np.float32)
    for fn in (mse, mae, rmse, max_abs, rel_l2, sqnr_db):
        with pytest.raises(ValueError, match=r"^shape mismatch: reference \[1, 2, 2\] vs test \[1, 2, 3\]$"):
            fn(ref, test)
