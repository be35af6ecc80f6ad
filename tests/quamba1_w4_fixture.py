"""A Quamba2 W4A8 or W4A16 checkpoint of a Mamba-1 model written by hand from Quamba's sources, with no harness
code (the Marlin packing: tests/marlin_fixture.py, itself written out from quamba/marlin_utils.py).

enyac-group/Quamba c474646: ``W4A8QMamba`` (quamba/qMambaLayer.py:512-645) keeps W8A8QMamba's QCausalConv1D,
W8A8B8O8Linear dt_proj, QSScan and QHadamard, with W4A8B8O8Linear in_proj and x_proj and a W4A8B16O16Linear
out_proj; ``W4A16QMamba`` (:230-368) keeps the fp16 model's conv1d, dt_proj (no bias), dt_proj_bias, A_log and D,
with W4A16B16O16Linear in_proj, x_proj and out_proj. The values are seeded random codes and scales: the tests
use them to prove the harness runs the file's tensors as they are.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from conftest import TOKENIZER
from marlin_fixture import pack_linear

D_MODEL, N_LAYER, D_STATE, VOCAB, D_CONV = 256, 2, 16, 4096, 4
E, R = 2 * D_MODEL, math.ceil(D_MODEL / 16)


def _f16(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float16))


def _w4a8_rest(sd: dict, i: int, g: torch.Generator) -> dict:
    """W8A8QMamba's keys of block i but the three Marlin-QQQ linears; returns the activation scales by name."""
    p, m = f"backbone.layers.{i}.", f"backbone.layers.{i}.mixer."
    rand = lambda lo, hi: lo + (hi - lo) * float(torch.rand((), generator=g))  # noqa: E731
    i8 = lambda *shape: torch.randint(-127, 128, shape, generator=g).to(torch.int8)  # noqa: E731
    t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731 - 0-dim fp32 buffers (qSelectiveScan.py:84-100)
    s = {"in": _f16(rand(0.02, 0.04)), "xz": _f16(rand(0.05, 0.1)), "u": _f16(rand(0.01, 0.03)),
         "xp": _f16(rand(0.02, 0.05)), "dt": _f16(rand(0.01, 0.03)), "h": _f16(rand(0.01, 0.1)),
         "H": _f16(rand(0.01, 0.05))}
    sd[p + "norm.weight"] = torch.ones(D_MODEL, dtype=torch.float16)      # qNorm.py:20
    sd[p + "norm.output_scale"] = s["in"]                                # qNorm.py:39, a Python float
    c = m + "conv1d."                                                    # qConvLayer.py:28-32, 75-79
    sd[c + "weight"], sd[c + "bias"] = i8(E, D_CONV), i8(E)
    sd[c + "weight_scale"], sd[c + "bias_scale"] = _f16(rand(0.01, 0.05)), _f16(rand(0.001, 0.005))
    sd[c + "input_scale"], sd[c + "output_scale"] = s["xz"], s["u"]
    # dt_proj: W8A8B8O8Linear.from_fp16(input_scale=x_proj:output, output_scale=dt_proj:output) (qMambaLayer.py:
    # 616-621): int8 [out, in] padded to 16 rows, stored transposed; a, b fp32 [1, 1]; alpha a Python float
    # (qLinearLayer.py:565-592)
    s_w = _f16(rand(0.005, 0.02))
    sd[m + "dt_proj.weight"] = torch.cat([i8(E, R), torch.zeros((16 - E % 16) % 16, R, dtype=torch.int8)]).t()
    sd[m + "dt_proj.a"] = torch.tensor([[s["xp"] / s["dt"]]], dtype=torch.float32)
    sd[m + "dt_proj.b"] = torch.tensor([[s_w]], dtype=torch.float32)
    sd[m + "dt_proj.alpha"] = (torch.tensor(s_w, dtype=torch.float32) * s["xp"] / s["dt"]).item()
    q = m + "selective_scan."                                            # qSelectiveScan.py:83-100, 131-132
    sd[q + "dt_bias"], sd[q + "dt_bias_scale"] = i8(E), t(rand(0.01, 0.03))
    sd[q + "A_log"], sd[q + "A_scale"] = i8(E, D_STATE).abs(), t(rand(0.01, 0.02))
    sd[q + "D"], sd[q + "D_scale"] = i8(E), t(rand(0.005, 0.01))
    sd[q + "u_scale"], sd[q + "dt_scale"], sd[q + "z_scale"] = t(s["u"]), t(s["dt"]), t(s["xz"])
    shared = t(s["xp"])
    sd[q + "B_scale"], sd[q + "C_scale"], sd[q + "ssm_state_scale"] = shared, shared, t(s["h"])
    sd[m + "had.x_H_scale"] = s["H"]                                     # qHadamard.py:18-19
    return s


def _w4a16_rest(sd: dict, i: int, g: torch.Generator) -> None:
    """The fp16 model's tensors W4A16QMamba.from_fp16 copies (qMambaLayer.py:345-368); the norm stays RMSNorm."""
    p, m = f"backbone.layers.{i}.", f"backbone.layers.{i}.mixer."
    sd[p + "norm.weight"] = torch.ones(D_MODEL, dtype=torch.float16)     # folded (modelutils_mamba.py:55)
    sd[m + "conv1d.weight"] = (torch.randn(E, 1, D_CONV, generator=g) * 0.3).to(torch.float16)
    sd[m + "conv1d.bias"] = (torch.randn(E, generator=g) * 0.1).to(torch.float16)
    sd[m + "dt_proj.weight"] = (torch.randn(E, R, generator=g) * 0.1).to(torch.float16)
    sd[m + "dt_proj_bias"] = (torch.randn(E, generator=g) - 3).to(torch.float16).float()  # MambaSimple: .float() (:63)
    sd[m + "A_log"] = torch.log(torch.arange(1, D_STATE + 1, dtype=torch.float32)).repeat(E, 1)
    sd[m + "D"] = torch.rand(E, generator=g) + 0.5


def w4_mamba1_state_dict(recipe: str, seed: int = 0) -> tuple[dict, dict]:
    """(state dict, {(layer, linear): (codes, scales)}) of a W4A8QMamba or W4A16QMamba checkpoint."""
    g = torch.Generator().manual_seed(seed)
    w4a8 = recipe == "W4A8"
    sd = {"backbone.embedding.weight": (torch.randn(VOCAB, D_MODEL, generator=g) * 0.5).to(torch.float16)}
    truth = {}
    for i in range(N_LAYER):
        m = f"backbone.layers.{i}.mixer."
        s = _w4a8_rest(sd, i, g) if w4a8 else _w4a16_rest(sd, i, g)
        # input_scale: in_proj:input, x_proj:input, out_proj:input (qMambaLayer.py:593-644)
        for name, out, k, s_in in (("in_proj", 2 * E, D_MODEL, "in"), ("x_proj", R + 2 * D_STATE, E, "u"),
                                   ("out_proj", D_MODEL, E, "H")):
            codes = torch.randint(0, 16, (out, k), generator=g).to(torch.uint8)
            entries, scales = pack_linear(codes, w4a8, g, 0.01)
            if w4a8:
                entries["input_scale"] = torch.tensor(s[s_in], dtype=torch.float32)
            sd.update({f"{m}{name}.{key}": v for key, v in entries.items()})
            truth[(i, name)] = (codes, scales)
    sd["backbone.norm_f.weight"] = torch.ones(D_MODEL, dtype=torch.float16)
    sd["lm_head.weight"] = (torch.randn(VOCAB, D_MODEL, generator=g) * 0.5).to(torch.float16)
    return sd, truth


def w4_mamba1_config(recipe: str) -> dict:
    # MambaConfig fields + modelutils_mamba.py:863-868
    return {"d_model": D_MODEL, "d_intermediate": 0, "n_layer": N_LAYER, "vocab_size": VOCAB,
            "ssm_cfg": {"d_state": D_STATE, "layer": f"{recipe}QMamba"}, "attn_layer_idx": [], "attn_cfg": {},
            "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8,
            "tie_embeddings": False, "norm_cfg": {"norm": "QRMSNorm" if recipe == "W4A8" else "RMSNorm"},
            "embedding_cfg": {"layer": "Embedding"}, "lm_head_cfg": {"layer": "Linear"}}


def write_w4_mamba1(path: Path, recipe: str, sd: dict | None = None,
                    config: dict | None = None) -> tuple[Path, dict, dict]:
    """The directory, its state dict and the packed truth."""
    made, truth = w4_mamba1_state_dict(recipe)
    sd = made if sd is None else sd
    path.mkdir(parents=True, exist_ok=True)
    torch.save(sd, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(w4_mamba1_config(recipe) if config is None else config, indent=4))
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    return path, sd, truth
