"""harness.runner.sharedops: an op shared across the modes of a run changes no bit of any mode."""
import numpy as np
import pytest
import torch

from harness.runner.forwards import Forward, RefInputs, run_mode
from harness.emulation.capture import select_points
from harness.recipes.registry import resolve_modes
from harness.runner.sharedops import SharedOps
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
        alone = run_mode(Forward(recipe, sc, [ids], points, 0), bank)
        together = run_mode(Forward(recipe, sc, [ids], points, 0), bank, shared=shared)
        assert alone.arrays.keys() == together.arrays.keys() and len(alone.arrays) >= 14, recipe.name
        for name, arr in alone.arrays.items():
            assert _bits(arr) == _bits(together.arrays[name]), (recipe.name, name)
        assert alone.tensors == together.tensors, recipe.name
    # what the recipes have in common (docs/guarantees.md "Shared ops change no number"): the int8 norm of the seven rotated int8
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
    ref = run_mode(Forward(recipes["fp32"], None, samples, points, 0, keep_inputs=(0,)), bank)
    ref_inputs = RefInputs(True, ref.block_inputs)
    shared = SharedOps()
    for name in ("0", "2-0"):
        alone = run_mode(Forward(recipes[name], scales, samples, points, 0), bank, ref_inputs)
        together = run_mode(Forward(recipes[name], scales, samples, points, 0), bank, ref_inputs, shared=shared)
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
    two = SharedOps(max_bytes=2 * 24)  # room for two calls, not three: the bytes add up
    for x in (a, b, 2 * a):
        two.call(0, "op", op, op, x)
    assert two.kept_bytes == 48 and _count(two, op, b) == 1 and _count(two, op, 2 * a) == 0


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


def test_float_settings_match_by_their_bits():
    """A setting of -0.0 is not one of 0.0; a NaN setting matches the same NaN (Python floats by bits)."""
    shared, w = SharedOps(), torch.ones(1)
    x = torch.ones(1, 3)
    shared.call(0, "op", Scale(w, 0.0), Scale(w, 0.0), x)
    assert _count(shared, Scale(w, -0.0), x) == 0 and _count(shared, Scale(w, 0.0), x) == 1
    nan = float("nan")
    shared.call(0, "op", Scale(w, nan), Scale(w, nan), x)
    assert _count(shared, Scale(w, nan), x) == 1
    assert _count(shared, Scale(w, 0), x) == 0  # an int 0 is another setting than a float 0.0


def test_other_views_of_the_same_memory_do_not_match():
    """Rows 0 and 1 of one tensor (same storage, other offset) and a matrix and its transpose (same
    offset, other strides) are other inputs."""
    shared, op = SharedOps(), Scale(torch.ones(1))
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    shared.call(0, "op", op, op, t[0])
    assert _count(shared, op, t[1]) == 0 and _count(shared, op, t[0]) == 1
    shared.call(0, "op", op, op, t)
    assert _count(shared, op, t.t()) == 0 and _count(shared, op, t.t().t()) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.bfloat16])
def test_every_float_width_compares_bits(dtype):
    shared, op = SharedOps(), Scale(torch.ones(1))
    zero = torch.zeros(2, 3, dtype=dtype)
    shared.call(0, "op", op, op, zero)
    assert _count(shared, op, -zero) == 0 and _count(shared, op, zero.clone()) == 1


def test_an_input_of_another_rank_is_a_clean_miss():
    """(2, 3) kept, (6,) of the same values given: another input (no error from comparing positions)."""
    shared, op = SharedOps(), Scale(torch.ones(1))
    x = torch.arange(6.0)
    shared.call(0, "op", op, op, x.reshape(2, 3))
    assert _count(shared, op, x) == 0


def test_module_class_hooks_and_training_mode():
    """Another class with the same attributes, or with other attributes, is another op; the training flag
    is no setting; a module with a forward hook is never shared (its hook fires on every call)."""
    class Twice(Scale):
        def forward(self, x):
            return super().forward(x) * 2

    shared, w, x = SharedOps(), torch.ones(1), torch.ones(1, 3)
    first = shared.call(0, "op", Scale(w), Scale(w), x)
    twice = Twice(w)
    assert torch.equal(shared.call(0, "op", twice, twice, x), first * 2)
    class Shift(torch.nn.Module):  # other attributes (only `weight`): other settings
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

        def forward(self, x):
            return x - self.weight

    shift = Shift(w)
    assert torch.equal(shared.call(0, "op", shift, shift, x), x - 1)  # not Scale's x * 2
    evaluated = Scale(w).eval()
    assert _count(shared, evaluated, x) == 1
    seen = []
    hooked = Scale(w)
    hooked.register_forward_hook(lambda _m, _i, out: seen.append(out))
    assert _count(shared, hooked, x) == 0 and _count(shared, hooked, x) == 0 and len(seen) == 2


def test_the_summary_and_the_bytes_kept_count_codes_and_results():
    """kept_bytes counts every storage a kept call holds once: int8 codes, results, a result given back
    as an input (held already). The summary in MB, rounded to 0.1."""
    n = (1 << 19) + (1 << 15)                                          # bytes of codes; the fp32 result 4 n
    shared, op = SharedOps(max_bytes=(3 << 20) + (1 << 17)), Scale(torch.ones(1))   # 3.125 MB
    codes = torch.ones(1, n, dtype=torch.int8)
    out = shared.call(0, "op", op, op, QTensor(codes, 0.5))
    assert shared.kept_bytes == 5 * n                                  # 2.65625 MB
    shared.call(0, "op", op, op, out)                                 # its input is held: + 4 n result: no room
    assert shared.kept_bytes == 5 * n
    assert _count(shared, op, QTensor(codes.clone(), 0.5)) == 1
    assert shared.summary() == {"calls": 3, "reused": 1, "reused_by_op": {"op": 1}, "kept_mb": 2.7, "max_mb": 3.1}


def test_an_int4_weight_setting_matches_by_identity():
    """A Marlin linear's Int4Weight (several tensors, whose == is element-wise) is a weight: the same object shares,
    an equal copy does not (and comparing the two raises nothing: q2-w4a16 beside q2-w4ax's W4A16 layers)."""
    from harness.kernels.int4 import rtn_int4
    from harness.recipes.quamba.w4.block_mamba2 import EmuW4A16Linear
    w = rtn_int4(torch.randn(256, 128, generator=torch.Generator().manual_seed(0)), False)
    copy = type(w)(w.codes.clone(), w.group_scales.clone(), None, w.group_size)
    ops, x = SharedOps(), torch.randn(1, 3, 128).half().float()
    first = ops.call(0, "in_proj", EmuW4A16Linear(w), EmuW4A16Linear(w), x)
    assert ops.call(0, "in_proj", EmuW4A16Linear(w), EmuW4A16Linear(w), x) is first
    other = ops.call(0, "in_proj", EmuW4A16Linear(copy), EmuW4A16Linear(copy), x)
    assert other is not first and torch.equal(other, first) and ops.reused["in_proj"] == 1
