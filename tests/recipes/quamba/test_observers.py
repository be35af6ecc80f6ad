import pytest
import torch

from harness.recipes.quamba.observers import MinMaxObserver, PercentileObserver, quantile_high


@pytest.mark.parametrize("alpha", [0.9995, 0.99999, 0.9, 0.5, 1.0])
@pytest.mark.parametrize("n", [1, 7, 1000, 40000])
def test_quantile_high_is_torch_quantile_bit_exactly(alpha, n):
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(n)).abs()
    expected = torch.stack([torch.quantile(row, alpha) for row in x])
    assert torch.equal(quantile_high(x, alpha), expected)


def test_percentile_ema_by_hand():
    obs = PercentileObserver(alpha=0.5)
    samples = torch.tensor([[[1.0, 3.0]], [[2.0, 6.0]], [[0.0, 1.0]]])  # quantile(|a|, 0.5) = 2, 4, 0.5
    obs.observe(samples[:2])
    obs.observe(samples[2:])
    w = torch.tensor(2.0)
    for cur in (4.0, 0.5):
        w = w + 0.01 * (torch.tensor(cur) - w)
    assert obs.ema.item() == w.item()
    assert obs.compute_scale() == float(w / 127)
    assert obs.state()["samples"] == 3
    assert obs.state()["raw_max"] == 6.0


def test_raw_max_of_activations_below_one():
    """raw_max starts from nothing seen (a mutant that started it at 1.0 survived: every sample above had a
    larger maximum)."""
    obs = PercentileObserver(alpha=0.5)
    obs.observe(torch.tensor([[[0.25, -0.5]]]))
    assert obs.state()["raw_max"] == 0.5


def test_quantile_high_at_an_integer_rank_next_to_an_overflow():
    """At an integer rank torch.quantile takes v[below] alone: a row whose next value is inf (an fp16 overflow)
    still gives the finite quantile (a mutant that interpolated with weight 0 gave 0 * inf = NaN)."""
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, 5.0, 4.0]])
    expected = torch.stack([torch.quantile(row, 0.5) for row in x])
    assert expected.tolist() == [2.0, 4.0] and torch.equal(quantile_high(x, 0.5), expected)


def test_percentile_batched_equals_one_by_one():
    x = torch.randn(6, 50, 8, generator=torch.Generator().manual_seed(0))
    a, b = PercentileObserver(0.99), PercentileObserver(0.99)
    a.observe(x)
    for i in range(6):
        b.observe(x[i:i + 1])
    assert a.ema.item() == b.ema.item()


def test_minmax_is_fp16_and_floored():
    obs = MinMaxObserver()
    obs.observe(torch.tensor([[0.1, -3.00001]]))
    obs.observe(torch.tensor([[2.0]]))
    amax16 = torch.tensor(3.00001).half()
    assert obs.compute_scale() == float((amax16 / 127).float())


def test_observers_refuse_to_compute_before_data():
    with pytest.raises(RuntimeError, match="seen no data"):
        MinMaxObserver().compute_scale()
    with pytest.raises(RuntimeError, match="seen no data"):
        PercentileObserver(0.99).compute_scale()


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_alpha_outside_range_is_rejected(alpha):
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        PercentileObserver(alpha)


def test_percentile_observer_reads_fp16_values():
    """Values off the fp16 grid are rounded to fp16 before the quantile, as the fp16 calibration model holds
    them (a mutant that skipped the cast survived: every caller passes fp16-grid values already)."""
    x = torch.tensor([[1.0, -2.0004, 0.5]])   # fp16(2.0004) = 2.0
    obs = PercentileObserver(1.0)
    obs.observe(x)
    assert float(obs.ema) == 2.0 and obs.raw_max == 2.0
