"""MambaQuant's calibration statistics (the notes §4.3), on the untransformed fp32 model: per-channel max |x| of
out_proj's and dt_proj's inputs (S2, S5: smoothquant_generate_act_scale_shift.py:402-453), float64 covariances of
in_proj's, out_proj's and dt_proj's inputs (the KLT: get_klt_matrix.py:305-363), and per-channel quantiles
0.999999 of |h| over (batch, length, d_state) and of |C| over (batch, length) from the first two windows (S3, S4:
smoothquant_get_matmul_scale.py:392-488). The upstream takes the KLT from one batch of 8 windows and the amax from
128; here every statistic but S3/S4 covers the whole calibration set. Cached per layer (runner.statcache)."""
from __future__ import annotations

import torch

from ...architectures.registry import get_architecture
from ...emulation.fakequant import ChannelAmaxObserver, CovarianceObserver, wrap_mamba1
from ...emulation.modules import EmuBackbone
from ...kernels.field_transforms import covariance, quantile_rows
from ...runner.statcache import cached_statistics
from .scan import MQScan

__all__ = ["calibrate_mq", "QUANTILE", "S_WINDOWS"]

QUANTILE = 0.999999
S_WINDOWS = 2  # S3 / S4 statistics: the first two windows (smoothquant_get_matmul_scale.py)


class _HC:
    """|h| per d_inner channel and |C| per d_state channel of the first S_WINDOWS sequences."""

    def __init__(self) -> None:
        self.h, self.c, self.seen = [], [], 0

    def __call__(self, H: torch.Tensor, C: torch.Tensor) -> None:
        take = min(S_WINDOWS - self.seen, H.shape[0])
        if take > 0:
            self.h.append(H[:take].abs().permute(2, 0, 1, 3).reshape(H.shape[2], -1))
            self.c.append(C[:take].abs().reshape(-1, C.shape[-1]).T)
            self.seen += take

    def s3_s4(self) -> tuple[torch.Tensor, torch.Tensor]:
        s3 = quantile_rows(torch.cat(self.h, dim=1), QUANTILE).clamp(min=1e-2)           # quant_naive.py:607-610
        s4 = quantile_rows(torch.cat(self.c, dim=1), QUANTILE).clamp(min=1e-2, max=100)  # :612-618
        return s3, s4


def _observed(mode, bank, depth):
    blocks = get_architecture("mamba1").build_blocks(mode, bank, None, depth, False)
    obs = []
    for block in blocks:
        o = {"amax_out": ChannelAmaxObserver(), "amax_dt": ChannelAmaxObserver(), "cov_in": CovarianceObserver(),
             "cov_out": CovarianceObserver(), "cov_dt": CovarianceObserver(), "hc": _HC()}
        wrap_mamba1(block, {"in_proj.in": o["cov_in"],
                            "out_proj.in": lambda x, a=o["amax_out"], c=o["cov_out"]: c(a(x)),
                            "dt_proj.in": lambda x, a=o["amax_dt"], c=o["cov_dt"]: c(a(x))})
        s = block.ssm
        block.ssm = MQScan(s.A_log, s.D, s.dt_bias, gate_s=None, R3=None, S3=None, observe=o["hc"])
        obs.append(o)
    return blocks, obs


def _layer(o: dict) -> dict:
    s3, s4 = o["hc"].s3_s4()
    return {"amax_out": o["amax_out"].amax, "amax_dt": o["amax_dt"].amax, "s3": s3, "s4": s4,
            **{k: _cov(o[k]) for k in ("cov_in", "cov_out", "cov_dt")}}


def _cov(obs: CovarianceObserver) -> torch.Tensor:
    if obs.n < 2:
        covariance(torch.zeros(obs.n, 1))  # the TransformError naming the token count
    return obs.covariance()


def calibrate_mq(mode, bank, windows, settings, depth: int, prefix_hashes, cache_dir):
    """The statistics of layers 0..depth (a CalibrationResult whose scales are per-layer dicts)."""
    def compute():
        blocks, obs = _observed(mode, bank, depth)
        model = EmuBackbone(lambda ids: bank.embed(ids, False, torch.float32, "exact", "fp32"), blocks)
        for batch in windows.split(settings.batch_size):
            model(batch)
        return [_layer(o) for o in obs]
    return cached_statistics("mambaquant", "mambaquant", windows, settings, depth, prefix_hashes, cache_dir,
                             compute=compute, extra={"quantile": QUANTILE, "s_windows": S_WINDOWS})
