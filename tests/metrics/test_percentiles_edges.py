"""The brackets of percentiles.py where they are narrow, open or miss by one: error_metrics over chunks (a
small _LEAF, as tests/runner/test_fixed_costs.py does) and abs_percentiles still equal np.percentile exactly."""
import numpy as np
import pytest

from harness.metrics import errors as metrics
from harness.metrics.errors import error_metrics
from harness.metrics.percentiles import _order_stats, abs_percentiles, ranks_of, sample_step


def _percentiles(ref, test):
    d = np.abs(test.astype(np.float64) - ref.astype(np.float64))
    return [float(v) for v in np.percentile(d, [50, 90, 99])]


@pytest.mark.parametrize("n", [64, 640])
def test_chunked_percentiles_of_a_small_array_with_open_brackets(n, monkeypatch):
    """n = 64: every key is sampled and every bracket is open at both ends (mutant percentiles _in_bracket 31
    took keys[None], a (1, n) view, and failed; metrics _row 71 counted the float values instead of their
    int64 keys and returned a value's integer part as its bit pattern). n = 640: the 90th percentile's
    bracket ends exactly at the sample's end, an open end (percentiles Brackets._prepare 26 read sample[m])."""
    monkeypatch.setattr(metrics, "_LEAF", 8)
    rng = np.random.default_rng(n)
    ref = rng.standard_normal((2, n // 2)).astype(np.float32)
    test = (ref + rng.standard_normal(ref.shape)).astype(np.float32)
    row = error_metrics(ref, test)
    assert [row["p50"], row["p90"], row["p99"]] == _percentiles(ref, test)


def test_chunks_count_the_keys_below_a_bracket_in_every_chunk(monkeypatch):
    """Two chunks: the first holds 3 tiny |d| and the largest value, the second 1 .. 4096. The median's
    bracket has 3 keys below it in the first chunk: a count of the last chunk's alone still passes the
    bracket check and picks the key 3 ranks too high (mutant percentiles Brackets.count 10: p50 4096.5, not
    4093.5)."""
    monkeypatch.setattr(metrics, "_LEAF", 4096)
    n = 8192
    test = np.empty(n, np.float32)
    test[:3] = [1e-3, 2e-3, 3e-3]
    test[3:4096] = 1e6
    test[4096:] = np.arange(1, 4097)
    row = error_metrics(np.zeros(n, np.float32), test)
    assert [row["p50"], row["p90"], row["p99"]] == [4093.5, 1e6, 1e6] == _percentiles(np.zeros(n), test)


def test_chunked_percentiles_fall_back_on_a_multi_dimensional_array(monkeypatch):
    """The brackets miss (every sampled |d| is 0) on a (3, 32768) array: |d| taken whole must be flattened
    before the partition (mutant metrics _row 115 kept its shape: the partition ran along the last axis)."""
    monkeypatch.setattr(metrics, "_LEAF", 4096)
    shape = (3, 2 ** 15)
    n = shape[0] * shape[1]
    ref = np.zeros(shape, np.float32)
    test = np.arange(1, n + 1, dtype=np.float32)
    test[::sample_step(n)] = 0.0
    test = test.reshape(shape)
    row = error_metrics(ref, test)
    assert [row["p50"], row["p90"], row["p99"]] == _percentiles(ref, test)


def test_abs_percentiles_when_a_bracket_misses_by_one():
    """2**15 values, every 17th sampled: 15355 keys of 0.5 and the sample 1000 .. 2927 put exactly 16384 keys
    at or below the median's upper bound, whose ranks are 16383 and 16384: the bracket misses by one and
    the whole array decides (mutant percentiles _pick 7 accepted it and partitioned past its end)."""
    n = 2 ** 15
    step = sample_step(n)
    sampled = np.arange(0, n, step)
    others = np.setdiff1d(np.arange(n), sampled)
    values = np.empty(n)
    values[sampled] = 1000.0 + np.arange(sampled.size)
    values[others[:15355]] = 0.5
    values[others[15355:]] = 1e6
    assert (step, sampled.size) == (17, 1928)
    assert _order_stats(values.copy().view(np.int64), ranks_of(n)) is None  # the bracket missed
    assert list(abs_percentiles(values.copy())) == [float(v) for v in np.percentile(values, [50, 90, 99])]
