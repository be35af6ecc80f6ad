"""The recurrent step of the emulated blocks: fp32 against transformers' cached decoding, prefill/decode
consistency, the prefill's hand-over of its state, and the W8A8 step's int8 states."""
import numpy as np
import pytest
import torch

from harness.checkpoints.loading import open_checkpoint
from harness.runner.backbone import build_backbone
from harness.emulation.capture import capture
from harness.kernels.state_update import handover_codes
from harness.modes import BUILTIN_MODES
from harness.runner.forwards import build_head
from harness.runner.weightbank import WeightBank
from harness.spec import QTensor
from helpers import observed_bank

L, N = 10, 6


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 4096, (1, L + N), generator=torch.Generator().manual_seed(7))


def _hf_decode(model, ids):
    """transformers' cached decoding: the prompt, then one token a step; logits and (conv, ssm) per layer per step."""
    out = model(input_ids=ids[:, :L], use_cache=True)
    cache, logits, states = out.cache_params, [], []
    for k in range(L, L + N):
        out = model(input_ids=ids[:, k:k + 1], cache_params=cache, use_cache=True)
        cache = out.cache_params
        logits.append(out.logits[:, -1].clone())
        states.append([(cache.get_conv_state(i, state_idx=0).clone(), cache.get_recurrent_state(i, state_idx=0).clone())
                       for i in range(len(model.backbone.layers))])
    return logits, states


def test_fp32_step_is_transformers_cached_decoding(hf_model, hf_dir, ids):
    bank = WeightBank(open_checkpoint(hf_dir))
    recipe = BUILTIN_MODES["fp32"]
    model = build_backbone(recipe, bank, None, bank.dims.n_layer - 1)
    head = build_head(recipe, bank)
    with torch.no_grad():
        want_logits, want_states = _hf_decode(hf_model, ids)
        residual, states = model.prefill(ids[:, :L])
        for k in range(N):
            residual, states = model.step(ids[:, L + k:L + k + 1], states)
            assert _rel(head(residual)[:, 0], want_logits[k]) < 1e-5
            for (conv, ssm), state in zip(want_states[k], states):
                assert _rel(state.conv_values(), conv) < 1e-6 and _rel(state.ssm_values(), ssm) < 1e-5


@pytest.mark.parametrize("mode", ["fp32", "1"])
def test_float_step_matches_the_prefill_at_the_same_positions(hf_dir, ids, mode):
    """fp32: the step repeats the prefill's arithmetic (zero up to the GEMV's rounding); mode 1's fp16 state
    (mamba_ssm stores an fp16 model's state in fp16) costs more."""
    bank = WeightBank(open_checkpoint(hf_dir))
    recipe = BUILTIN_MODES[mode]
    model = build_backbone(recipe, bank, None, bank.dims.n_layer - 1)
    full = model(ids)
    residual, states = model.prefill(ids[:, :L])
    steps = []
    for k in range(N):
        residual, states = model.step(ids[:, L + k:L + k + 1], states)
        steps.append(residual)
    err = _rel(torch.cat(steps, 1), full[:, L:])
    assert err < (1e-6 if mode == "fp32" else 1e-2)
    if mode == "1":
        assert states[0].ssm.dtype == torch.float32 and torch.equal(
            states[0].ssm, states[0].ssm.to(torch.float16).float())


@pytest.fixture(scope="module")
def observed(hf_dir):
    return observed_bank(hf_dir, L + N)


def test_w8a8_prefill_hands_over_int8_codes(observed):
    bank, scales, ids = observed
    recipe = BUILTIN_MODES["0"]
    model = build_backbone(recipe, bank, scales, 0)
    with capture(model, ["L0.conv1d.in", "L0.ssm.state"]) as got:
        _, states = model.prefill(ids[:, :L])
    state = states[0]
    assert isinstance(state.conv, QTensor) and isinstance(state.ssm, QTensor)
    assert state.ssm.scale == scales[0].s_h and state.conv.scale == scales[0].s_xz
    assert torch.equal(state.conv.codes, got["L0.conv1d.in"].codes[0, -4:].t()[None])   # the last K x codes
    assert torch.equal(state.ssm.codes, handover_codes(got["L0.ssm.state"].values, scales[0].s_h).codes)


def test_short_prompt_window_is_zero_padded(observed):
    bank, scales, ids = observed
    model = build_backbone(BUILTIN_MODES["0"], bank, scales, 0)
    _, states = model.prefill(ids[:, :2])
    assert states[0].conv.codes.shape[-1] == 4 and int(states[0].conv.codes[..., :2].abs().sum()) == 0


@pytest.mark.parametrize("mode", ["0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"])
def test_w8a8_step_keeps_int8_states_and_stays_near_the_prefill(observed, mode):
    bank, scales, ids = observed
    recipe = BUILTIN_MODES[mode]
    model = build_backbone(recipe, bank, scales, 0)
    full = model(ids)
    residual, states = model.prefill(ids[:, :L])
    steps = []
    for k in range(N):
        with capture(model, ["L0.in_proj.out", "L0.norm.out"]) as got:
            residual, states = model.step(ids[:, L + k:L + k + 1], states)
        steps.append(residual)
        assert isinstance(states[0].ssm, QTensor) and states[0].ssm.codes.dtype == torch.int8
        assert (mode == "3") != isinstance(states[0].conv, QTensor)   # mode 3: float window, dynamic scale
        if mode != "3":   # the int8 in_proj of one token is the GEMV
            from harness.kernels.step import w8a8_gemv_ref
            norm = got["L0.norm.out"]
            want = w8a8_gemv_ref(QTensor(norm.codes, norm.scale), model.blocks[0].in_proj.weight,
                                 model.blocks[0].in_proj.out)
            assert torch.equal(got["L0.in_proj.out"].codes, want.codes)
    err = _rel(torch.cat(steps, 1) - ids.new_zeros(()), full[:, L:])
    assert 0 < err < 0.1   # what the int8 states cost, measured: about 0.02 on this model


def test_a_state_format_holds_in_the_decode_steps(hf_dir, ids):
    """state_format puts the SSM state in the format after every step of the scan; the decode step runs that
    scan over one token, so the carried state is in the format after every step too (here bf16)."""
    from dataclasses import replace

    from harness.formats import fake_quantize

    bank = WeightBank(open_checkpoint(hf_dir))
    recipe = replace(BUILTIN_MODES["fp32"], name="bf16state", state_format="bf16")
    model = build_backbone(recipe, bank, None, 1)
    _, states = model.prefill(ids[:, :L])
    plain = build_backbone(BUILTIN_MODES["fp32"], bank, None, 1)
    _, plain_states = plain.prefill(ids[:, :L])
    for k in range(3):
        _, states = model.step(ids[:, L + k:L + k + 1], states)
        _, plain_states = plain.step(ids[:, L + k:L + k + 1], plain_states)
        for st, ps in zip(states, plain_states):
            h = st.ssm_values()
            assert torch.equal(h.to(torch.bfloat16).float(), h)              # on the bf16 grid
            assert not torch.equal(h, ps.ssm_values())                       # and not the fp32 state
            assert torch.equal(fake_quantize(h, "bf16"), h)
