"""Metric details the hand-computed cases do not reach: the standalone max_abs, zero cases, every stats field."""
import math
import warnings

import numpy as np
import pytest

from harness.metrics.errors import (
    METRIC_NAMES,
    cosine,
    error_metrics,
    mae,
    max_abs,
    mse,
    pearson,
    rel_l2,
    rmse,
    sqnr_db,
    tensor_stats,
)


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


def test_sqnr_of_a_reference_with_unit_energy():
    """sum ref^2 = 1 exactly is an ordinary signal: 10 log10(1 / 0.25) dB (mutant metrics _sqnr_sums 4 took a
    signal of 1.0 for a zero one and gave -inf)."""
    ref, test = np.array([1.0, 0.0]), np.array([0.5, 0.0])
    assert sqnr_db(ref, test) == 10 * math.log10(4.0)
    assert error_metrics(ref, test)["sqnr_db"] == 10 * math.log10(4.0)


def test_orthogonal_arrays_of_unit_norm_give_zero_cosine_and_pearson():
    """||ref|| ||test|| = 1 and the centred product of norms = 1 exactly: cosine and pearson are 0, defined
    (mutants metrics _row 168 and 175 read a denominator of 1.0 as a zero one and gave nan)."""
    ref = np.array([0.5, -0.5, 0.5, -0.5])
    test = np.array([0.5, 0.5, -0.5, -0.5])
    m = error_metrics(ref, test)
    assert (m["cosine"], m["pearson"]) == (0.0, 0.0) and "undefined" not in m
    assert (cosine(ref, test), pearson(ref, test)) == (0.0, 0.0)


def test_cosine_and_pearson_are_nan_not_inf_when_a_norm_underflows():
    """ref's squares (1e-340) underflow to 0 while <ref, test> = 2e-70 does not: the zero norm makes cosine
    and pearson undefined (nan), never +-inf, in error_metrics as in the single formulas (mutants metrics
    _row 165 and 172 divided by the zero norm and gave inf)."""
    ref = np.array([1e-170, -1e-170])
    test = np.array([1e100, -1e100])
    m = error_metrics(ref, test)
    assert math.isnan(m["cosine"]) and math.isnan(m["pearson"])
    assert math.isnan(cosine(ref, test)) and math.isnan(pearson(ref, test))
    assert set(m["undefined"]) == {"rel_l2", "cosine", "pearson"}  # ||ref|| computes as 0: rel_l2 too


def test_rows_of_non_finite_and_empty_arrays():
    """Every metric nan, max_abs_index the mode's first non-finite position, and "undefined" giving, for
    every metric, the NaN / Inf counts and first positions of both arrays (mutants metrics _nonfinite_note
    1, 2, 8-14 and error_metrics 12-36: no note for a float array, garbled counts, names or positions, the
    reference's position in place of the mode's, the row's keys renamed). Empty arrays: the reason is
    "both arrays are empty" (error_metrics 11 sent them to the formulas, which fail)."""
    ref = np.zeros((2, 2, 3), np.float32)
    test = np.ones((2, 2, 3), np.float32)
    test[0, 1, 2], test[1, 0, 0] = np.nan, -np.inf
    ref[0, 0, 1] = np.inf
    row = error_metrics(ref, test)
    why = ("the mode's array holds 1 NaN and 1 Inf values (first at (0, 1, 2)); "
           "the reference holds 0 NaN and 1 Inf values (first at (0, 0, 1))")
    assert sorted(row) == sorted(METRIC_NAMES + ("undefined",))
    assert row["max_abs_index"] == [0, 1, 2]
    assert all(math.isnan(row[k]) for k in METRIC_NAMES if k != "max_abs_index")
    assert row["undefined"] == {k: why for k in METRIC_NAMES if k != "max_abs_index"}
    assert error_metrics(np.zeros(3), np.array([1.0, np.inf, np.inf]))["undefined"]["mse"] == \
        "the mode's array holds 0 NaN and 2 Inf values (first at (1,))"
    empty = error_metrics(np.zeros((2, 0, 3), np.float32), np.zeros((2, 0, 3), np.float32))
    assert empty["max_abs_index"] == [] and all(math.isnan(empty[k]) for k in METRIC_NAMES if k != "max_abs_index")
    assert empty["undefined"] == {k: "both arrays are empty" for k in METRIC_NAMES if k != "max_abs_index"}


def test_undefined_names_each_nan_metric_of_finite_arrays_and_nothing_else():
    """Finite arrays: "undefined" maps exactly the nan metrics to their reasons, and is absent when none is
    nan (mutants metrics error_metrics 46, 48, 49: no map, None, or the key renamed)."""
    zero, one = np.zeros((1, 2, 2), np.float32), np.ones((1, 2, 2), np.float32)
    assert error_metrics(zero, one)["undefined"] == {
        "rel_l2": "the reference is all zeros (||ref|| = 0) but the mode is not",
        "cosine": "an array is all zeros (zero norm)", "pearson": "an array is constant (zero variance)"}
    ramp = np.arange(4, dtype=np.float32).reshape(1, 2, 2)
    assert "undefined" not in error_metrics(ramp, ramp * ramp)


def test_stats_of_empty_single_and_overflowed_tensors():
    """An empty capture: mean, std, min, max nan, l2 0, no overflow (mutants metrics overflow_fractions 3, 4,
    tensor_stats 99, 103: 1.0 overflowed, min()/max() of nothing). One value is not "empty" (tensor_stats 15).
    A single +inf of an fp16 capture is all overflow (overflow_fractions 2), and its stats are computed
    quietly: inf - inf in the centred sum raises no RuntimeWarning (tensor_stats 42 dropped the errstate)."""
    e = tensor_stats(np.zeros((0, 3), np.float32))
    assert {k: e[k] for k in ("shape", "first_10", "l2", "nan_count", "inf_count", "overflow_upper",
                              "overflow_lower")} == {"shape": [0, 3], "first_10": [], "l2": 0.0, "nan_count": 0,
                                                     "inf_count": 0, "overflow_upper": 0.0, "overflow_lower": 0.0}
    assert all(math.isnan(e[k]) for k in ("mean", "std", "min", "max"))
    one = tensor_stats(np.array([3.0], np.float32))
    assert (one["mean"], one["std"], one["min"], one["max"], one["l2"]) == (3.0, 0.0, 3.0, 3.0, 3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = tensor_stats(np.array([np.inf], np.float32), source_dtype="float16")
    assert (s["overflow_upper"], s["overflow_lower"]) == (1.0, 0.0)
    assert (s["mean"], s["max"], s["l2"]) == (math.inf, math.inf, math.inf)
    assert math.isnan(s["std"]) and s["inf_count"] == 1


def test_the_largest_finite_value_is_not_an_overflow():
    """+-65504 is float16's largest finite value: it fits, only beyond it counts (mutants metrics
    overflow_fractions 12 and 15 counted the limit itself)."""
    s = tensor_stats(np.array([65504, -65504, 0, 1], np.float16))
    assert (s["overflow_upper"], s["overflow_lower"]) == (0.0, 0.0)


def test_clipped_fraction_of_a_single_code():
    """One code, clipped: the fraction is 1 (mutant metrics tensor_stats 135 divided by at least 2)."""
    s = tensor_stats(np.array([127.0], np.float32), np.array([127], np.int8), 1.0, 1)
    assert s["clipped_fraction"] == 1.0 and s["saturated_fraction"] == 1.0
