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


def test_every_name_of_a_capture_point_comes_from_one_place():
    """Module path, point, tensor name and npz key of every site at layers 0 and 2: the module path finds
    the HookPoint of that point in a built backbone, and the key parses back to the tensor."""
    import torch

    from harness.emulation.capture import (POINTS, array_key, module_path, parse_array_key, parse_point,
                                           point_name, tensor_name)
    from harness.emulation.modules import EmuMambaBlock
    from harness.spec import HookPoint

    blocks = torch.nn.ModuleDict({"blocks": torch.nn.ModuleList(
        [EmuMambaBlock.__new__(EmuMambaBlock) for _ in range(3)])})
    for layer, block in enumerate(blocks["blocks"]):
        torch.nn.Module.__init__(block)
        EmuMambaBlock.__init__(block, layer, None, norm=None, in_proj=None, conv1d=None, x_proj=None, dt_proj=None,
                               ssm=None, had=None, out_proj=None, u_input=None)
    modules = dict(blocks.named_modules())
    for layer in (0, 2):
        for site in POINTS:
            point = point_name(layer, site)
            hook = modules[module_path(layer, site)]
            assert isinstance(hook, HookPoint) and (hook.layer, hook.point) == (layer, site) == parse_point(point)
            tensor = tensor_name(point)
            assert parse_array_key(array_key("2-4", tensor)) == ("2-4", tensor)
    assert [tensor_name(point_name(0, s)) for s in ("block.in", "block.out", "block.residual")] == \
        ["input", "output", "residual"]
    assert array_key("0", "input") == "mode_0_input" and array_key("0", "L2.block.in") == "mode_0__L2.block.in"
    assert tensor_name("L2.block.in") == "L2.block.in" and parse_array_key("token_ids") is None


def test_points_are_in_layer_then_data_flow_order():
    """Layer 10 after layer 2 (not lexicographic), and within a layer the order of capture.POINTS."""
    from harness.emulation.capture import POINTS, point_name, select_points
    got = select_points([10, 2], ["all"])
    assert got == [point_name(layer, p) for layer in (2, 10) for p in POINTS]
