"""The paired difference from the reference: the aggregations as lm-eval's, the bootstrap interval, the flips."""
from __future__ import annotations

import math

import numpy as np
import pytest

from harness.lmeval.paired import aggregate, flipped, paired_difference


def test_aggregations_match_lm_evals():
    metrics = pytest.importorskip("lm_eval.api.metrics")
    lls = [-1.5, -0.25, -3.0, -0.5]
    pairs = [(-10.0, 4), (-3.0, 2), (-7.5, 5)]
    assert aggregate("mean", [1, 0, 1, 1]) == metrics.mean([1, 0, 1, 1])
    assert math.isclose(aggregate("perplexity", lls), metrics.perplexity(lls), rel_tol=1e-12)
    assert math.isclose(aggregate("weighted_perplexity", pairs), metrics.weighted_perplexity(pairs), rel_tol=1e-12)
    assert math.isclose(aggregate("bits_per_byte", pairs), metrics.bits_per_byte(pairs), rel_tol=1e-12)


def test_paired_difference_is_exact_and_its_interval_holds_it():
    rng = np.random.default_rng(1)
    ref = rng.normal(-2.0, 1.0, 200)
    mode = ref - 0.1 + rng.normal(0, 0.01, 200)  # a small shift, small per-example noise
    d = paired_difference("mean", list(mode), list(ref), iters=500, seed=3)
    assert math.isclose(d["difference"], float(mode.mean() - ref.mean()), rel_tol=1e-12)
    assert d["low"] < d["difference"] < d["high"] < 0  # the shift is seen: the interval excludes 0
    # paired: far narrower than the spread of either mode's own mean (sd 1 / sqrt(200) = 0.07)
    assert d["high"] - d["low"] < 0.01
    assert paired_difference("mean", list(mode), list(ref), iters=500, seed=3) == d  # seeded


def test_identical_modes_differ_by_zero_with_a_zero_interval():
    vals = [(-3.0, 2), (-1.0, 1), (-4.0, 3)]
    d = paired_difference("weighted_perplexity", vals, vals, iters=200)
    assert d["difference"] == 0.0 and d["low"] == 0.0 and d["high"] == 0.0 and d["n"] == 3


def test_one_example_has_no_interval_and_lengths_must_agree():
    assert paired_difference("mean", [1.0], [0.0])["low"] is None
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference("mean", [1.0, 0.0], [0.0])


def test_flipped_lists_the_examples_lost_and_gained():
    assert flipped([5, 6, 7, 8], [1, 0, 1, 0], [1, 1, 0, 0]) == {"lost": [6], "gained": [7]}
