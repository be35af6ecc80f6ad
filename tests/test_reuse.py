"""harness.reuse: an op shared across the modes of a run changes no bit of any mode."""
import numpy as np
import pytest
import torch

from harness.analysis import RefInputs, run_mode
from harness.capture import select_points
from harness.modes import resolve_modes
from harness.reuse import SharedOps
from harness.spec import QTensor
from helpers import observed_bank, run_modes


def _bits(a: np.ndarray) -> bytes:
    return a.dtype.str.encode() + str(a.shape).encode() + np.ascontiguousarray(a).tobytes()


@pytest.fixture(scope="module")
def observed(hf_dir):
    return observed_bank(hf_dir, 40)


def test_every_array_and_stat_of_every_mode_is_the_one_computed_alone(observed):
    """Each of the nine built-in modes run alone (nothing shared) and run after the others with one SharedOps:
    every tap's array (all fifteen, codes included in the stats) bit for bit, and its stats entry."""
    bank, scales, ids = observed
    points = select_points([0], ["all"])
    shared = SharedOps()
    for recipe in resolve_modes(["all", "1"], None):
        sc = scales if recipe.needs_calibration else None
        alone = run_mode(recipe, bank, sc, [ids], points, 0, "original")
        together = run_mode(recipe, bank, sc, [ids], points, 0, "original", shared=shared)
        assert alone.arrays.keys() == together.arrays.keys() and len(alone.arrays) >= 14, recipe.name
        for name, arr in alone.arrays.items():
            assert _bits(arr) == _bits(together.arrays[name]), (recipe.name, name)
        assert alone.tensors == together.tensors, recipe.name
    # what the recipes have in common (README "Shared ops"): the int8 norm of the seven rotated int8
    # modes, in_proj of 0 and 2-x, the int8 conv of 0 and 2-0..2-2 and the fp32 conv of 2-3 and 2-4,
    # x_proj and dt_proj after each, and from the scan on 2-0 (u re-quantized losslessly) and 2-2; more
    # where this model's data make other inputs equal (here 2-3's u, re-quantized at s_u with RNE, equals
    # 2-1's RNA codes, and 2-1's int8 Hadamard output equals mode 0's although their scans differ)
    got = shared.summary()["reused_by_op"]
    assert (got["norm"], got["in_proj"], got["conv1d"]) == (6, 5, 4), got
    assert min(got["x_proj"], got["dt_proj"]) >= 4 and min(got["ssm"], got["had"], got["out_proj"]) >= 2, got
    assert got["original_basis.block.in"] == 6, got  # the seven rotated fp16 modes enter with one embedding


def test_the_isolated_replay_and_a_second_sample_share_too(observed):
    """Two samples and the isolated replay on the reference's inputs: the same arrays as alone."""
    bank, scales, ids = observed
    g = torch.Generator().manual_seed(3)
    samples = [ids, torch.randint(0, bank.dims.vocab_size, ids.shape, generator=g)]
    points = select_points([0], ["ssm.out", "block.out"]) + ["L0.block.isolated"]
    recipes = {r.name: r for r in resolve_modes(["fp32", "0", "2-0"], None)}
    ref = run_mode(recipes["fp32"], bank, None, samples, points, 0, "original", keep_inputs=(0,))
    from harness.analysis import RefInputs
    ref_inputs = RefInputs(True, ref.block_inputs)
    shared = SharedOps()
    for name in ("0", "2-0"):
        alone = run_mode(recipes[name], bank, scales, samples, points, 0, "original", ref_inputs)
        together = run_mode(recipes[name], bank, scales, samples, points, 0, "original", ref_inputs, shared=shared)
        for tensor, arr in alone.arrays.items():
            assert _bits(arr) == _bits(together.arrays[tensor]), (name, tensor)
    # 2-0's scan of each sample, and of each sample's replay on the reference's block input
    assert shared.summary()["reused_by_op"]["ssm"] == 4


class Scale(torch.nn.Module):
    """A toy op: x * weight * factor (any dtype)."""

    def __init__(self, weight: torch.Tensor, factor: float = 2.0) -> None:
        super().__init__()
        self.weight, self.factor = weight, factor

    def forward(self, x):
        return (x.dequantize() if isinstance(x, QTensor) else x) * self.weight.to(torch.float32) * self.factor


def _count(shared: SharedOps, module, *args) -> int:
    before = sum(shared.reused.values())
    shared.call(0, "op", module, module, *args)
    return sum(shared.reused.values()) - before


def test_inputs_match_bit_for_bit_only():
    shared, op = SharedOps(), Scale(torch.tensor([1.0, 2.0, 3.0]))
    x = torch.tensor([[0.0, 1.0, 2.0]])
    first = shared.call(0, "op", op, op, x)
    assert shared.call(0, "op", op, op, x.clone()) is first           # equal bits, another tensor
    assert shared.call(0, "op", op, op, x.view(3)[None]) is first     # a view of the same memory
    assert _count(shared, op, torch.tensor([[-0.0, 1.0, 2.0]])) == 0   # -0.0 is not 0.0
    assert _count(shared, op, x.to(torch.float64)) == 0                # another dtype
    assert _count(shared, op, x.view(3)) == 0                          # the same memory, another shape
    assert _count(shared, Scale(op.weight, 2.5), x) == 0               # other settings
    assert _count(shared, Scale(op.weight, 2.0), x) == 1               # equal settings, the same weight object
    assert _count(shared, Scale(op.weight.clone()), x) == 0            # equal weights, but not the same object
    shared.call(1, "op", op, op, x)
    assert shared.reused == {"op": 3} and shared.calls == 10          # layer 1 is another op
    nan = torch.tensor([[float("nan"), 1.0, 2.0]])
    assert _count(shared, op, nan) == 0 and _count(shared, op, nan.clone()) == 1  # the same NaN bits match
    assert _count(shared, op, -nan) == 0                               # another NaN's bits do not


def test_qtensor_inputs_match_on_scale_and_codes():
    shared, op = SharedOps(), Scale(torch.ones(3))
    codes = torch.tensor([[4, 5, -6]], dtype=torch.int8)
    shared.call(0, "op", op, op, QTensor(codes, 0.25, 0))
    assert _count(shared, op, QTensor(codes.clone(), 0.25, 7)) == 1   # n_clipped is no input of an op
    assert _count(shared, op, QTensor(codes, 0.25000001)) == 0
    assert _count(shared, op, QTensor(codes + 1, 0.25)) == 0
    assert _count(shared, op, codes.to(torch.float32) * 0.25) == 0     # real values are not codes


def test_calls_beyond_max_bytes_are_computed_and_not_kept():
    op = Scale(torch.ones(3))
    shared = SharedOps(max_bytes=2 * 12)  # room for one call: its input and its result, 12 bytes each
    a, b = torch.ones(1, 3), torch.zeros(1, 3)
    shared.call(0, "op", op, op, a)
    shared.call(0, "op", op, op, b)
    assert shared.kept_bytes == 24
    assert _count(shared, op, a) == 1 and _count(shared, op, b) == 0
    assert _count(shared, op, torch.ones(1, 3)) == 1
    kept = shared.call(0, "op", op, op, a)
    assert _count(shared, op, kept) == 0 and shared.kept_bytes == 24  # a result as input: held already, but no room


def test_the_main_job_records_what_it_shared(hf_dir, tmp_path):
    out = run_modes(hf_dir, tmp_path, ["fp32", "0", "2-0"])
    shared = out.stats["provenance"]["shared_ops"]
    # eight ops and three original-basis transforms (block.in, block.out, block.residual) per mode; 2-0
    # shares all eight ops with 0, and all three inputs of the transforms; 0 shares fp32's block input
    # only if its embedding were fp32 (it is fp16: no)
    assert shared["calls"] == 3 * (8 + 3) and shared["reused"] == sum(shared["reused_by_op"].values())
    assert shared["reused_by_op"] == {"conv1d": 1, "dt_proj": 1, "had": 1, "in_proj": 1, "norm": 1, "out_proj": 1,
                                      "ssm": 1, "x_proj": 1, "original_basis.block.in": 1,
                                      "original_basis.block.out": 1, "original_basis.block.residual": 1}
    assert np.array_equal(out.by_mode["0"]["output"], out.by_mode["2-0"]["output"])


def test_inputs_differing_only_before_or_only_at_the_last_position_do_not_match():
    """The last position is compared first (a quick no): an input equal there but not before must still
    not match, nor one that differs only there."""
    shared, op = SharedOps(), Scale(torch.ones(2))
    y = torch.arange(6.0).reshape(1, 3, 2)
    shared.call(0, "op", op, op, y)
    early, late = y.clone(), y.clone()
    early[0, 0, 1] = 7.0
    late[0, 2, 0] = 7.0
    assert _count(shared, op, early) == 0 and _count(shared, op, late) == 0
    assert _count(shared, op, y.clone()) == 1
