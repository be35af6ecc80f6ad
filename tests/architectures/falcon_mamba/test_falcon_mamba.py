"""Falcon-Mamba: read as its own architecture (never as plain Mamba-1), the fp32 mode against transformers'
FalconMambaForCausalLM per layer, for the logits and in cached decoding, the norms' capture points, and the
Mamba-1 recipes on it."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from harness.checkpoints.loading import ModelDirError, open_checkpoint
from harness.emulation.capture import MIXER_NORM_POINTS, capture, points_of
from harness.emulation.norms import bound_scale
from harness.recipes.registry import get_mode
from harness.runner.backbone import build_backbone
from harness.runner.forwards import _to_original, build_head
from harness.runner.weightbank import WeightBank

from falcon_fixtures import make_falcon_mamba

SEQ = 13


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("falcon") / "tf"
    return make_falcon_mamba(out, layers=3, tie=request.param, seed=3 + request.param), out


def _ids(seed: int = 5, n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(seed))


def _transformers_run(hf, ids):
    mixers, blocks = [], []
    hooks = [layer.mixer.register_forward_hook(lambda m, i, o: mixers.append(o.detach())) for layer in hf.backbone.layers]
    hooks += [layer.register_forward_hook(lambda m, i, o: blocks.append(o.detach())) for layer in hf.backbone.layers]
    with torch.no_grad():
        logits = hf(ids).logits
    for h in hooks:
        h.remove()
    return mixers, blocks, logits


def _harness_run(path, mode: str, ids, points=("block.out", "block.residual")):
    recipe = get_mode(mode)
    bank = WeightBank(open_checkpoint(path))
    n = bank.dims.n_layer
    backbone = build_backbone(recipe, bank, None, n - 1)
    with capture(backbone, [f"L{i}.{p}" for i in range(n) for p in points]) as cap:
        residual = backbone(ids)
    rot = recipe.rotate == "yes"
    basis = lambda p, x: _to_original(x, rot) if p.startswith("block.") else x  # noqa: E731  (residual basis)
    got = {p: [basis(p, cap[f"L{i}.{p}"].values) for i in range(n)] for p in points}
    return bank.dims, got, build_head(recipe, bank)(residual)


def test_a_falcon_mamba_directory_is_read_as_falcon_mamba(model):
    _, path = model
    ckpt = open_checkpoint(path)
    assert ckpt.dims.architecture == "falcon_mamba" and ckpt.dims.mixer_rms_eps == 1e-6
    assert (ckpt.dims.dt_rank, ckpt.dims.d_state, ckpt.dims.d_inner) == (4, 8, 64)
    assert list(points_of("falcon_mamba"))[7:10] == list(MIXER_NORM_POINTS)  # right after x_proj.out


def test_fp32_equals_transformers_per_layer_and_logits(model):
    hf, path = model
    ids = _ids()
    t_mix, t_block, t_logits = _transformers_run(hf, ids)
    dims, got, logits = _harness_run(path, "fp32", ids)
    for i in range(dims.n_layer):
        assert rel(got["block.out"][i], t_mix[i]) <= 1e-5, (i, rel(got["block.out"][i], t_mix[i]))
        assert rel(got["block.residual"][i], t_block[i]) <= 1e-5
    assert rel(logits, t_logits) <= 1e-5


def test_without_the_norms_it_would_be_another_model(model, tmp_path):
    """The same weights read as plain Mamba-1 (model_type mamba) are far from transformers' Falcon-Mamba: the
    computation above is not Mamba-1's by accident."""
    hf, path = model
    plain = tmp_path / "as-mamba"
    shutil.copytree(path, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg.update(model_type="mamba", architectures=["MambaForCausalLM"])
    (plain / "config.json").write_text(json.dumps(cfg))
    ids = _ids()
    _, _, t_logits = _transformers_run(hf, ids)
    dims, _, logits = _harness_run(plain, "fp32", ids)
    assert dims.architecture == "mamba1" and rel(logits, t_logits) > 1e-2


def test_the_norm_points_hold_the_normalised_parts(model):
    _, path = model
    points = ("x_proj.out", *MIXER_NORM_POINTS)
    dims, got, _ = _harness_run(path, "fp32", _ids(), points)
    for i in range(dims.n_layer):
        dt, B, C = got["x_proj.out"][i].split([dims.dt_rank, dims.d_state, dims.d_state], dim=-1)
        for raw, normed in ((dt, got["dt_norm.out"][i]), (B, got["b_norm.out"][i]), (C, got["c_norm.out"][i])):
            want = raw.double() / (raw.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
            assert rel(normed, want) <= 1e-6


def test_fp32_step_is_transformers_cached_decoding(model):
    hf, path = model
    prompt, steps = 7, 5
    ids = _ids(9, prompt + steps)
    bank = WeightBank(open_checkpoint(path))
    ours, head = build_backbone(get_mode("fp32"), bank, None, bank.dims.n_layer - 1), build_head(get_mode("fp32"), bank)
    with torch.no_grad():
        out = hf(input_ids=ids[:, :prompt], use_cache=True)
        cache = out.cache_params
        _, states = ours.prefill(ids[:, :prompt])
        for k in range(prompt, prompt + steps):
            out = hf(input_ids=ids[:, k:k + 1], cache_params=cache, use_cache=True)
            cache = out.cache_params
            residual, states = ours.step(ids[:, k:k + 1], states)
            assert rel(head(residual)[:, 0], out.logits[:, -1]) <= 1e-5, k


def test_the_w8a8_norm_outputs_are_int8_at_their_bound():
    """sqrt(n) / 127 bounds a weightless RMSNorm's output: a row with all its weight on one element reaches it."""
    for n in (4, 8, 16, 64):
        s = bound_scale(n)
        assert s * 127 >= n ** 0.5 and s == float(torch.tensor(s, dtype=torch.float32))
        from harness.emulation.norms import EmuWeightlessRMSNorm
        from harness.spec import QuantOut, Rounding
        x = torch.zeros(1, 1, n)
        x[..., 0] = 5.0
        y = EmuWeightlessRMSNorm(1e-6, QuantOut(s, Rounding.HALF_EVEN))(x)
        assert int(y.codes.abs().max()) == 127 and y.n_clipped == 0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Every Mamba-1 recipe family through the whole run on a Falcon-Mamba (4096-token vocabulary, tokenizer)."""
    from conftest import ROOT
    from helpers import run_modes

    d = tmp_path_factory.mktemp("falconrun") / "model"
    hf = make_falcon_mamba(d, layers=2, vocab=4096, tie=False, seed=7)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ROOT / "models" / "mamba-tiny" / name, d / name)
    out = tmp_path_factory.mktemp("falconout")
    result = run_modes(d, out, ["fp32", "1", "0", "3", "q2-w4a8", "q2-w4a16"], layers=["all"], taps=["all"],
                       seq_len=16, samples=1, end_to_end=True)
    return hf, result


def test_every_mamba1_recipe_runs_on_falcon_mamba(run):
    hf, result = run
    assert list(result.by_mode) == ["fp32", "1", "0", "3", "q2-w4a8", "q2-w4a16"] and not result.failed
    assert result.stats["provenance"]["model"]["architecture"] == "falcon_mamba"
    with torch.no_grad():
        ref = hf(input_ids=torch.as_tensor(result.token_ids)).logits
    assert rel(result.by_mode["fp32"]["logits"].reshape(ref.shape), ref) <= 1e-5
    kl = {m: r["kl"]["mean"] if isinstance(r["kl"], dict) else r["kl"] for m, r in result.stats["end_to_end"].items()}
    assert kl["fp32"] == 0 < kl["1"] < kl["0"] and all(0 < kl[m] < 1.0 for m in ("3", "q2-w4a8", "q2-w4a16"))
    for mode in ("0", "q2-w4a8"):  # W8A8 activations: the norm outputs are int8 at their bound sqrt(n) / 127
        for point, width in (("dt_norm.out", 4), ("b_norm.out", 8), ("c_norm.out", 8)):
            values = result.by_mode[mode][f"L1.{point}"].astype("float64")
            codes = values / bound_scale(width)
            assert abs(codes - codes.round()).max() < 1e-3 and abs(codes).max() <= 127, (mode, point)
    values = result.by_mode["q2-w4a16"]["L1.b_norm.out"]  # W4A16: fp16 activations
    assert (torch.as_tensor(values).half().float().numpy() == values).all()


def test_presets_of_recipes_it_lacks_are_exit_2_naming_its_own():
    """`se`, `5`, `6` and `field` (the Quamba-SE study, the field's recipes: Mamba-1 and Mamba-2 only) name no mode
    on Falcon-Mamba: the modes they expand to were each refused with another recipe's message; now the preset is,
    with the presets that run there."""
    from harness.modes.knobs import ModeError
    from harness.recipes.registry import resolve_modes

    for preset in ("se", "5", "6", "field"):
        with pytest.raises(ModeError, match=f"preset '{preset}' has no modes for a falcon_mamba model; valid there: "
                                            "all = fp32 0 2-0"):
            resolve_modes([preset], None, "falcon_mamba")
    assert [r.name for r in resolve_modes(["essential"], None, "falcon_mamba")] == ["fp32", "0", "2-1", "2-2", "2-4"]
