import pytest
import torch

from harness.emulation.capture import TAP_POINTS, TapError, capture, parse_point, point_sort_key, select_points
from harness.spec import HookPoint, QTensor


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = HookPoint("norm.out", 0)
        self.b = HookPoint("ssm.u", 1)

    def forward(self, x):
        y = self.a(x * 2)
        if x.sum() < 0:
            raise RuntimeError("boom")
        return self.b(QTensor(torch.ones(2, dtype=torch.int8), 0.5)), y


def test_capture_records_real_values_and_removes_hooks_on_error():
    model = Toy()
    with capture(model, ["L0.norm.out", "L1.ssm.u"]) as got:
        model(torch.ones(2))
    assert torch.equal(got["L0.norm.out"].values, torch.full((2,), 2.0))
    assert got["L1.ssm.u"].quantized and got["L1.ssm.u"].scale == 0.5
    assert torch.equal(got["L1.ssm.u"].values, torch.full((2,), 0.5))
    with pytest.raises(RuntimeError, match="boom"):
        with capture(model, ["L0.norm.out"]):
            model(-torch.ones(2))
    assert not model.a._forward_hooks and not model.b._forward_hooks


def test_point_names_sort_numerically():
    names = ["L10.block.in", "L2.ssm.u", "L2.block.in", "L0.block.residual"]
    assert sorted(names, key=point_sort_key) == ["L0.block.residual", "L2.block.in", "L2.ssm.u", "L10.block.in"]
    assert parse_point("L12.conv1d.out") == (12, "conv1d.out")
    with pytest.raises(TapError, match="expected L<layer>.<point>"):
        parse_point("L1.conv2d.out")


def test_select_points():
    base = select_points([0], None)
    assert base == ["L0.block.in", "L0.block.out", "L0.block.residual"]
    assert len(select_points([0, 1], ["all"])) == 2 * (3 + len(TAP_POINTS))
    assert "L1.ssm.u" in select_points([0], ["L1.ssm.u"]) and "L1.block.in" in select_points([0], ["L1.ssm.u"])
    with pytest.raises(TapError, match=r"unknown tap 'ssm.v'; valid: all, norm.out"):
        select_points([0], ["ssm.v"])
