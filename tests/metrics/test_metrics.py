import math

import numpy as np
import pytest

from harness.metrics.errors import METRICS, error_metrics, tensor_stats


def test_metrics_by_hand():
    ref = np.array([[[1.0, 2.0], [3.0, 4.0]]], dtype=np.float32)
    test = np.array([[[1.0, 2.5], [2.0, 4.0]]], dtype=np.float32)  # d = 0, .5, -1, 0
    m = error_metrics(ref, test)
    assert m["mse"] == pytest.approx((0.25 + 1.0) / 4)
    assert m["mae"] == pytest.approx(1.5 / 4)
    assert m["rmse"] == pytest.approx(math.sqrt(1.25 / 4))
    assert m["max_abs"] == 1.0 and m["max_abs_index"] == [0, 1, 0]
    assert m["rel_l2"] == pytest.approx(math.sqrt(1.25) / math.sqrt(30))
    assert m["sqnr_db"] == pytest.approx(10 * math.log10(30 / 1.25))
    assert m["cosine"] == pytest.approx(np.dot([1, 2, 3, 4], [1, 2.5, 2, 4]) / (math.sqrt(30) * math.sqrt(27.25)))
    assert m["pearson"] == pytest.approx(np.corrcoef([1, 2, 3, 4], [1, 2.5, 2, 4])[0, 1])
    assert m["p50"] == pytest.approx(0.25) and m["p99"] == pytest.approx(np.percentile([0, .5, 1, 0], 99))
    for name, fn in METRICS.items():
        assert fn(ref, test) == pytest.approx(m[name])


def test_identical_arrays():
    a = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    m = error_metrics(a, a)
    assert m["mse"] == 0 and m["mae"] == 0 and m["rel_l2"] == 0 and m["max_abs"] == 0
    assert m["sqnr_db"] == math.inf
    assert m["cosine"] == pytest.approx(1.0) and m["pearson"] == pytest.approx(1.0)


def test_edge_cases_are_defined():
    zero, one = np.zeros((1, 2, 2), np.float32), np.ones((1, 2, 2), np.float32)
    m = error_metrics(zero, one)
    assert math.isnan(m["rel_l2"]) and m["sqnr_db"] == -math.inf
    assert math.isnan(m["cosine"]) and math.isnan(m["pearson"])
    with pytest.raises(ValueError, match="shape mismatch"):
        error_metrics(zero, np.zeros((1, 2, 3), np.float32))


def test_tensor_stats():
    v = np.array([[1.0, -2.0, np.nan, np.inf]], dtype=np.float32)
    s = tensor_stats(v)
    assert s["nan_count"] == 1 and s["inf_count"] == 1 and s["shape"] == [1, 4]
    codes = np.array([127, -128, 3, 0], dtype=np.int8)
    q = tensor_stats(codes.astype(np.float32) * 0.5, codes, 0.5, 1)
    assert q["saturated_fraction"] == 0.5 and q["clipped_fraction"] == 0.25 and q["scale"] == 0.5
    assert q["first_10"] == [63.5, -64.0, 1.5, 0.0] and q["std"] == pytest.approx(np.std([63.5, -64, 1.5, 0]))
