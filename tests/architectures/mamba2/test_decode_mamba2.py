"""The Mamba-2 float step: fp32 against transformers' Mamba2ForCausalLM cached decoding (logits and both states
after every step), prefill/decode consistency, and --decode / --generate on Mamba-2 models."""
import json

import numpy as np
import pytest
import torch

from conftest import ROOT
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main
from harness.runner.backbone import build_backbone
from harness.recipes.registry import get_mode
from harness.runner.forwards import build_head
from harness.runner.weightbank import WeightBank
from harness.store.reader import load_capture
from harness.store.format import stats_path
from helpers import run_cli
from mamba2_fixtures import make_mamba2

L, N = 11, 6   # a prompt longer than chunk 8 (two chunks) and d_conv 4


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=[1, 2], ids=["ngroups1", "ngroups2"])
def m2(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"dm2g{request.param}")
    hf = make_mamba2(out, ngroups=request.param, layers=2, seed=10 + request.param)
    ids = torch.randint(0, 64, (1, L + N), generator=torch.Generator().manual_seed(request.param))
    return hf, out, ids


def _hf_decode(model, ids):
    """transformers' cached decoding: the prompt, then one token a step; logits and (conv, ssm) per layer per step."""
    with torch.no_grad():
        out = model(input_ids=ids[:, :L], use_cache=True)
        cache, logits, states = out.cache_params, [], []
        for k in range(L, L + N):
            out = model(input_ids=ids[:, k:k + 1], cache_params=cache, use_cache=True)
            cache = out.cache_params
            logits.append(out.logits[:, -1].clone())
            states.append([(cache.get_conv_state(i, state_idx=0).clone(),
                            cache.get_recurrent_state(i, state_idx=0).clone())
                           for i in range(len(model.backbone.layers))])
    return logits, states


def _ours(path, mode: str):
    bank = WeightBank(open_checkpoint(path))
    recipe = get_mode(mode)
    return build_backbone(recipe, bank, None, bank.dims.n_layer - 1), build_head(recipe, bank), bank.dims


def test_fp32_step_is_transformers_cached_decoding(m2):
    hf, path, ids = m2
    model, head, dims = _ours(path, "fp32")
    want_logits, want_states = _hf_decode(hf, ids)
    with torch.no_grad():
        residual, states = model.prefill(ids[:, :L])
        for k in range(N):
            residual, states = model.step(ids[:, L + k:L + k + 1], states)
            assert _rel(head(residual)[:, 0], want_logits[k]) < 1e-5
            for (conv, ssm), state in zip(want_states[k], states):
                assert state.conv_values().shape == conv.shape == (1, dims.conv_dim, dims.d_conv)
                assert _rel(state.conv_values(), conv) < 1e-6
                heads = state.ssm_values().reshape(ssm.shape)       # (batch, nheads, headdim, d_state)
                assert _rel(heads, ssm) < 1e-5


@pytest.mark.parametrize("mode", ["fp32", "1"])
def test_float_step_matches_the_prefill_at_the_same_positions(m2, mode):
    """fp32: the step equals the chunked prefill at positions L..L+N-1 up to rounding; mode 1 stores its state
    and window in fp16 between steps (as a float16 model's cache does) and differs more."""
    _, path, ids = m2
    model, _, _ = _ours(path, mode)
    with torch.no_grad():
        full = model(ids)
        residual, states = model.prefill(ids[:, :L])
        steps = []
        for k in range(N):
            residual, states = model.step(ids[:, L + k:L + k + 1], states)
            steps.append(residual)
    err = _rel(torch.cat(steps, 1), full[:, L:])
    assert err < (1e-5 if mode == "fp32" else 1e-2)
    if mode == "1":
        ssm = states[0].ssm
        assert err > 0 and torch.equal(ssm.float(), ssm.to(torch.float16).float())


def test_the_prefill_hands_over_the_last_d_conv_inputs_zero_padded(m2):
    _, path, ids = m2
    model, _, dims = _ours(path, "fp32")
    with torch.no_grad():
        _, states = model.prefill(ids[:, :2])     # shorter than d_conv: zeros in front
        _, again = model.step(ids[:, 2:3], states)
    conv = states[0].conv_values()
    assert conv.shape == (1, dims.conv_dim, dims.d_conv)
    assert torch.all(conv[..., :2] == 0) and torch.any(conv[..., 2:] != 0)
    assert torch.equal(again[0].conv_values()[..., :3], conv[..., 1:])


TINY2 = ROOT / "models" / "mamba2-tiny"


def test_decode_and_generate_run_the_float_modes_on_mamba2(tmp_path, capsys):
    out = tmp_path / "d.npz"
    assert run_cli(capture_main, ["--model", TINY2, "--modes", "fp32", "1", "--seq_len", "16", "--decode", "3",
                                  "--generate", "4", "--taps", "ssd.y", "--end-to-end", "--output_file", out,
                                  "--quiet"]) == 0, capsys.readouterr().err
    cap = load_capture(out)
    dims = open_checkpoint(TINY2).dims
    assert cap.array("1", "decode.L0.state.ssm").shape == (1, 3, dims.d_inner, dims.d_state)
    assert cap.array("1", "decode.L0.state.conv").shape == (1, 3, dims.conv_dim, dims.d_conv)
    assert cap.array("fp32", "decode.L0.ssd.y").shape == (1, 3, dims.d_inner)
    assert "decode.L0.ssd.state" not in cap.tensors("fp32")
    assert cap.array("fp32", "generated_ids").shape == (1, 4)
    modes = json.loads(stats_path(out).read_text())["modes"]
    cons = modes["fp32"]["decode"]["consistency"]["decode.logits"]["rel_l2"]
    assert cons < 1e-5 and modes["1"]["decode"]["consistency"]["decode.logits"]["rel_l2"] > cons
    assert len(modes["1"]["decode"]["per_step"]["decode.logits"]["kl"]) == 3
    assert {"first_divergence", "agreement"} <= set(modes["1"]["generate"])
    ours = cap.array("fp32", "generated_ids")
    assert np.array_equal(modes["fp32"]["generate"]["ids"], ours[0])
    from transformers import Mamba2ForCausalLM   # the fp32 mode's greedy ids are transformers' greedy generate

    hf = Mamba2ForCausalLM.from_pretrained(TINY2).eval()
    prompt = torch.from_numpy(np.array(cap.npz["token_ids"])[:, :16])
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=4, do_sample=False)[:, 16:]
    assert np.array_equal(ours, want.numpy())
