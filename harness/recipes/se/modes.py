"""The modes of the research fork 798253405/Quamba-SE (HEAD f4d350a; mode 4 as at 9688b7a), as its code computes
them: each mode's knobs beyond the harness's own (``SeKnobs``), and the ``ModeRecipe`` rows that name them.

Every citation is quamba/qMambaLayer.py at f4d350a unless it names another file (the specification with all
citations: docs/se-modes.md, /work/shared/reference/quamba-se-modes-notes.md). The base knobs of every row are
Quamba1's W8A8 block with a true-fp32 conv output (the fork's fwd_mode5: the int8 conv up to the SiLU, stored
fp32): weights=int8 rotate=yes norm_out=int8 in_proj_out=int8 conv_in=static conv_out=fp32 ssm_u=fp32
had_out=int8 act_dtype=fp16 prep=quamba.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...modes import ModeRecipe
from ...modes.knobs import KNOBS

__all__ = ["SeKnobs", "SE_KNOBS", "SE_MODES", "FAMILY", "AS_WRITTEN", "knobs_of"]

FAMILY = "quamba-se"


@dataclass(frozen=True)
class SeKnobs:
    """What a Quamba-SE mode does beyond the base row.

    u: the scan's u quantizer (kernels.vquant): grid | fp32 | outlier | dual-dyn | dual-cal | quarter | half |
       quarterlog2 | threeseg; u_round: rna (the fork's roundf_like, 5-x) | rne (torch.round, 4 and 6-x);
    conv: kernel (fwd_mode5: the int8 kernel's fp32 value) | torch (mode 4's dequantized F.conv1d, y*sigmoid(y));
    xproj: int8-conv (int8 GEMM on clamp(R(x_c/s)) codes) | int8-u (on clamp(R(u/s)): the re-rounding of the mixed
       value) | fp (F.linear on u with dequantized weights); xproj_round: the R of the int8 codes;
    xproj_out: int8 (the GEMM's int8 output at s_xp) | fp | grid (6-0: virtual int8 at s_xp, RNE);
    dt_out: int8 (int8 GEMM at s_dt) | fp | grid (6-0) | requant (6-4: dt at s_dt, B and C at s_xp, int8 RNE);
    scan: kernel (fwd_mode5/6: the int8 kernel with fp32 u) | mamba (mamba_ssm selective_scan_fn) | torch
       (9688b7a's PyTorch fp32 scan); a_scale: A = -exp(A_log_q * A_scale) (False: 6-2's -exp(A_log_q));
    u_order: blocked | striped (fwd_mode5/6's u loader at L = 128, 256; unverified on a GPU);
    div: recip (x * fl32(1/s), CUDA) | exact (x / s).
    """

    u: str
    u_round: str
    xproj: str
    xproj_round: str
    xproj_out: str = "int8"
    dt_out: str = "int8"
    scan: str = "kernel"
    conv: str = "kernel"
    a_scale: bool = True
    u_order: str = "blocked"
    div: str = "recip"

    def as_dict(self) -> dict[str, str]:
        return {k: str(v).lower() if isinstance(v, bool) else v for k, v in self.__dict__.items()}


_BASE = "int8 yes int8 int8 static fp32 fp32 {impl} int8 fp16 quamba"

# name -> (title, knobs); in the fork's code order
AS_WRITTEN: dict[str, tuple[str, SeKnobs]] = {
    "4": ("SE mode 4 (9688b7a): torch fp32 conv, s-grid u with fp32 outliers (RNE), int8 x_proj, PyTorch scan",
          SeKnobs("outlier", "rne", "int8-u", "rne", scan="torch", conv="torch")),  # qConvLayer.py:110-164; :1170-1187
    "5-0": ("SE 5-0 virtual INT8: u = clamp(RNA(x_c/s))*s, x_proj the same codes, fwd_mode5 scan",
            SeKnobs("grid", "rna", "int8-conv", "rna")),  # :1404-1527
    "5-1": ("SE 5-1 fp32 u, RNA x_proj codes, fwd_mode5 scan", SeKnobs("fp32", "rna", "int8-conv", "rna")),  # :1529-1665
    "5-2": ("SE 5-2 s-grid u with fp32 outliers (RNA), x_proj re-rounded", SeKnobs("outlier", "rna", "int8-u", "rna")),  # :1667-1738
    "5-3": ("SE 5-3 dual scale: outliers on a dynamic max/127 grid (RNA)", SeKnobs("dual-dyn", "rna", "int8-u", "rna")),  # :1740-1839
    "5-4": ("SE 5-4 quarter scale for |q|<32, clipped s-grid above (RNA), x_proj re-rounded",
            SeKnobs("quarter", "rna", "int8-u", "rna")),  # :1841-1987
    "5-6": ("SE 5-6 s/4 grid to 8s, log2 tail above (RNA), x_proj re-rounded",
            SeKnobs("quarterlog2", "rna", "int8-u", "rna")),  # :1989-2159
    "5-7": ("SE 5-7 three segments s/4, s, 4s (509 levels, RNA), x_proj re-rounded",
            SeKnobs("threeseg", "rna", "int8-u", "rna")),  # :2161-2324
    "6-0": ("SE 6-0 all virtual INT8 (RNE): u, x_proj out, dt; fp32 F.linear; mamba scan",
            SeKnobs("grid", "rne", "fp", "rne", xproj_out="grid", dt_out="grid", scan="mamba")),  # :2326-2423
    "6-1": ("SE 6-1 fp32 u, fp32 F.linear x_proj/dt_proj, mamba scan",
            SeKnobs("fp32", "rne", "fp", "rne", xproj_out="fp", dt_out="fp", scan="mamba")),  # :2425-2506
    "6-2": ("SE 6-2 s-grid u + fp32 outliers (RNE), fp32 x_proj, mamba scan, A without A_scale (as written)",
            SeKnobs("outlier", "rne", "fp", "rne", xproj_out="fp", dt_out="fp", scan="mamba", a_scale=False)),  # :2508-2588, bug :2553
    "6-3": ("SE 6-3 half scale for |q|<64, clipped s-grid above (RNE), fp32 x_proj, mamba scan",
            SeKnobs("half", "rne", "fp", "rne", xproj_out="fp", dt_out="fp", scan="mamba")),  # :2590-2681
    "6-4": ("SE 6-4 outliers on the alpha=1.0 calibration's grid (RNE), fp32 x_proj, int8 dt/B/C, fwd_mode5",
            SeKnobs("dual-cal", "rne", "fp", "rne", xproj_out="fp", dt_out="requant")),  # :2729-2822
}

# "+fixed": where the fix is unambiguous. 6-2: A's scale (as 6-0, 6-1, 6-3 do, :2399,2467,2650). 5-4, 5-6, 5-7:
# x_proj gets 5-0's codes of x_c, which their docstrings claim it does (:1852, :2002).
FIXED: dict[str, tuple[str, dict]] = {
    "6-2": ("with A's scale", {"a_scale": True}),
    "5-4": ("x_proj on 5-0's codes", {"xproj": "int8-conv"}),
    "5-6": ("x_proj on 5-0's codes", {"xproj": "int8-conv"}),
    "5-7": ("x_proj on 5-0's codes", {"xproj": "int8-conv"}),
}


def _rows() -> dict[str, tuple[str, SeKnobs]]:
    rows = dict(AS_WRITTEN)
    for name, (what, change) in FIXED.items():
        title, knobs = AS_WRITTEN[name]
        rows[f"{name}+fixed"] = (f"{title.split(' (as written)')[0]}; fixed: {what}", replace(knobs, **change))
    for name, (title, knobs) in AS_WRITTEN.items():  # the fwd_mode5 scan's u read order at L = 128, 256
        if knobs.scan == "kernel":
            rows[f"{name}+striped"] = (f"{title}; u read striped at L=128/256 (unverified on a GPU)",
                                       replace(knobs, u_order="striped"))
    for name, (title, knobs) in AS_WRITTEN.items():  # exact division instead of CUDA's reciprocal multiply
        rows[f"{name}+exactdiv"] = (f"{title}; exact x / s", replace(knobs, div="exact"))
    return rows


SE_KNOBS: dict[str, SeKnobs] = {name: knobs for name, (_, knobs) in _rows().items()}


def _mode(name: str, title: str, knobs: SeKnobs) -> ModeRecipe:
    impl = "reference" if knobs.scan != "kernel" else "kernel"
    return ModeRecipe(name, title, **dict(zip(KNOBS, _BASE.format(impl=impl).split(), strict=True)), family=FAMILY)


SE_MODES: tuple[ModeRecipe, ...] = tuple(_mode(n, t, k) for n, (t, k) in _rows().items())


def knobs_of(mode: ModeRecipe) -> SeKnobs:
    """A Quamba-SE mode's own knobs (a user mode based on one, e.g. from --modes_file, keeps its base's)."""
    if mode.name in SE_KNOBS:
        return SE_KNOBS[mode.name]
    raise KeyError(f"mode {mode.name!r} is not a Quamba-SE mode; valid: {', '.join(SE_KNOBS)}")
