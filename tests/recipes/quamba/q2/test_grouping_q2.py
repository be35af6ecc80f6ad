"""Quamba2's head/dim grouping (reorder_utils.py:85-134) on statistics whose clusters are plain by hand."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("sklearn", reason="scikit-learn (the [quamba2] extra: pip install -e '.[quamba2]') is not installed")

from harness.recipes.quamba.q2.grouping import group_ranges, group_wise_sort_indices  # noqa: E402


def _stats():
    """1 SSD group, 8 heads of 8 channels. Heads 0, 3: flat; 1, 6: one outlier channel; 2, 5: a ramp;
    4, 7: two outliers; channels shuffled within each head so sorting matters."""
    gen = torch.Generator().manual_seed(0)
    base = torch.linspace(1.0, 1.35, 8)                   # distinct values: KMeans needs distinct points
    flat = base
    outlier = torch.cat([base[:7], torch.tensor([20.0])])
    ramp = torch.arange(1.0, 9.0) + base / 10
    two = torch.cat([base[:6], torch.tensor([14.0, 15.0])])
    heads = [flat, outlier, ramp, flat, two, ramp, outlier, two]
    rows = [h[torch.randperm(8, generator=gen)] * (1 + 0.01 * k) for k, h in enumerate(heads)]
    return torch.stack(rows).flatten()


def test_heads_of_a_kind_form_one_group_and_channels_are_sorted():
    stats = _stats()
    r = group_wise_sort_indices(stats, headdim=8, ngroups=1)
    assert r.head_groups.tolist() == [[2, 2, 2, 2]]
    pairs = {frozenset(r.head_index[k:k + 2].tolist()) for k in range(0, 8, 2)}
    assert pairs == {frozenset({0, 3}), frozenset({1, 6}), frozenset({2, 5}), frozenset({4, 7})}
    # every head's channels come out ascending, and each head's channels stay inside that head
    ordered = stats[r.channel_index].reshape(8, 8)
    assert bool((ordered[:, 1:] >= ordered[:, :-1]).all())
    assert all(set((r.channel_index.reshape(8, 8)[k] // 8).tolist()) == {int(r.head_index[k])} for k in range(8))
    assert bool((r.dim_groups.sum(-1) == 8).all()) and r.dim_groups.shape == (1, 4, 4)
    heads, dims = group_ranges(r)
    assert heads.tolist() == [[2, 4, 6, 8]] and bool((dims[..., -1] == 8).all())


def test_groups_are_per_ssd_group():
    stats = torch.cat([_stats(), _stats().flip(0)])
    r = group_wise_sort_indices(stats, headdim=8, ngroups=2)
    assert r.head_groups.shape == (2, 4) and r.head_index.shape == (16,)
    assert set(r.head_index[:8].tolist()) == set(range(8)) and set(r.head_index[8:].tolist()) == set(range(8, 16))


def test_cross_head_observer_takes_the_max_of_each_block_over_batches():
    from harness.recipes.quamba.q2.observers import CrossHeadMinmaxObserver

    head_groups = torch.tensor([[1, 2]], dtype=torch.int32)             # 1 SSD group of 3 heads x 4 dims
    dim_groups = torch.tensor([[[3, 1], [2, 2]]], dtype=torch.int32)
    obs = CrossHeadMinmaxObserver(1, 4, head_groups, dim_groups)
    x = torch.zeros(1, 2, 12)
    x[0, 0, 2] = -5.0     # head 0, dim 2: head group 0, dim group 0
    x[0, 1, 3] = 7.0      # head 0, dim 3: dim group 1
    x[0, 0, 4 + 1] = 2.0  # head 1, dim 1: head group 1, dim group 0
    x[0, 1, 8 + 3] = -9.0  # head 2, dim 3: head group 1, dim group 1
    obs.update(x)
    obs.update(x * 0.5 + torch.tensor([0.0] * 4 + [3.0] + [0.0] * 7))  # a later batch raises one block only
    want = torch.tensor([[[5.0, 7.0], [3.0, 9.0]]]) / 127
    assert torch.equal(obs.scales(), want.to(torch.float32))
    empty = CrossHeadMinmaxObserver(1, 4, head_groups, dim_groups)
    empty.update(torch.zeros(1, 1, 12))
    assert torch.equal(empty.scales(), torch.full((1, 2, 2), 1e-6, dtype=torch.float32))  # 1e-5 / 127, clamped
    with pytest.raises(ValueError, match="add up to headdim"):
        CrossHeadMinmaxObserver(1, 4, head_groups, torch.tensor([[[3, 2], [2, 2]]]))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_statistics_are_named_not_left_to_scikit_learn(value):
    """A NaN reached AgglomerativeClustering, whose message is about imputers; now the channel is named."""
    stats = _stats()
    stats[13] = value
    with pytest.raises(ValueError, match=rf"x channel statistics \(conv1d.x, the head/dim clustering's input\) hold "
                                         rf"1 non-finite value\(s\), first channel 13 = {value}; they must be finite"):
        group_wise_sort_indices(stats, headdim=8, ngroups=1)


def test_a_head_of_zero_statistics_is_named():
    stats = torch.cat([_stats(), _stats()])
    stats[8 * 8 + 16:8 * 8 + 24] = 0.0  # SSD group 1, head 2
    with pytest.raises(ValueError, match=r"statistics \(conv1d.x\) of head 2 of SSD group 1 are all zero"):
        group_wise_sort_indices(stats, headdim=8, ngroups=2)


def test_a_nan_weight_fails_q2_w8a8_naming_the_layer_and_tensor(tmp_path, capsys):
    """q2-w8a8 on a Mamba-2 whose block-0 in_proj (its x rows) holds a NaN: the mode fails naming the tensor and
    the element, before any calibration pass (it failed in scikit-learn's AgglomerativeClustering)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from conftest import ROOT
    from harness.cli import capture_main
    from helpers import run_cli

    model = tmp_path / "m"
    shutil.copytree(ROOT / "models" / "mamba2-tiny", model)
    weights = load_file(model / "model.safetensors")
    weights["backbone.layers.0.mixer.in_proj.weight"][400, 5] = float("nan")  # rows 384..767: x
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    code = run_cli(capture_main, ["--model", model, "--modes", "q2-w8a8", "--seq_len", "16", "--calib_data_num", "4",
                                  "--calib_seqlen", "32", "--no_cache", "--quiet", "--output_file", tmp_path / "x.npz"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and "imput" not in err
    assert "layer 0: tensor backbone.layers.0.mixer.in_proj.weight holds 1 non-finite value(s) (NaN or inf), first " \
           "at [400, 5]: nan" in err
