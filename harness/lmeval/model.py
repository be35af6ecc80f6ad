"""lm-eval's model ``quamba-harness``: a mode of the harness behind lm-evaluation-harness's ``LM`` interface.

``model_args``: ``pretrained=DIR`` (a float model, or a Quamba / Quamba2 checkpoint with ``mamba_model_path=DIR``),
``mode=`` (default fp32), ``tokenizer=``, the calibration settings (``calib_data_num``, ``calib_seqlen``,
``percentile_alpha``, ``calib_batch_size``, ``seed``, ``calib_file``, ``cache_dir`` or ``no_cache=True``),
``plugin=`` (one module or file; several joined with ``;``), ``modes_file=``, ``max_length=`` (default 2048, as
lm-eval's ``hf`` model on a config without one), ``device=cpu|cuda``, ``batch_size=``. The kwargs lm-eval always
passes (``batch_size``, ``max_batch_size``, ``device``) are taken.

Scoring follows lm-eval's ``hf`` backend (lm-eval 0.4.13, lm_eval/models/huggingface.py:1226-1306 and
``_loglikelihood_tokens``): the input is ``(context + continuation)[-(max_length + 1):][:-1]``, log-softmax in
fp32 over the continuation's positions, the sum of its tokens' log-probabilities and whether every one is the
argmax; rolling windows from ``lm_eval.utils.get_rolling_token_windows`` with ``prefix_token_id`` (the tokenizer's
end-of-text id) and ``context_len=1``. Requests run sorted by length in right-padded batches (a Mamba block is
causal: padding after a sequence leaves its positions unchanged); modes with a dynamic quantizer run one at a time.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from ..runner.calibration import CalibrationSettings, default_cache_dir
from .session import EvalSession, SessionKey, session_for

__all__ = ["QuambaHarnessLM", "session_key", "DEFAULT_MAX_LENGTH", "DEFAULT_MAX_GEN_TOKS"]

DEFAULT_MAX_LENGTH = 2048   # lm-eval's hf model: _DEFAULT_MAX_LENGTH (huggingface.py)
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf model: max_gen_toks


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes")


def session_key(pretrained, mamba_model_path=None, tokenizer=None, *, calib: dict | None = None,
                plugin=None, modes_file=None) -> SessionKey:
    """The SessionKey of model_args (strings as lm-eval parses them, or typed values)."""
    c = dict(calib or {})
    settings = CalibrationSettings(
        num_samples=int(c.get("calib_data_num", CalibrationSettings.num_samples)),
        seqlen=int(c.get("calib_seqlen", CalibrationSettings.seqlen)),
        alpha=float(c.get("percentile_alpha", CalibrationSettings.alpha)),
        batch_size=int(c.get("calib_batch_size", CalibrationSettings.batch_size)),
        seed=int(c.get("seed", CalibrationSettings.seed)))
    cache = None if _flag(c.get("no_cache", False)) else Path(c["cache_dir"]) if c.get("cache_dir") else \
        default_cache_dir()
    plugins = tuple(p for p in (plugin if isinstance(plugin, (list, tuple)) else str(plugin or "").split(";")) if p)
    extra = {"calib_file": Path(c["calib_file"]).resolve()} if c.get("calib_file") else {}
    return SessionKey(Path(pretrained).resolve(), Path(mamba_model_path).resolve() if mamba_model_path else None,
                      Path(tokenizer).resolve() if tokenizer else None, settings, cache_dir=cache, plugins=plugins,
                      modes_file=Path(modes_file).resolve() if modes_file else None, **extra)


_CALIB_ARGS = ("calib_data_num", "calib_seqlen", "percentile_alpha", "calib_batch_size", "seed", "calib_file",
               "cache_dir", "no_cache")


class QuambaHarnessLM(TemplateLM):
    """One mode of the harness as an lm-eval model (registered as ``quamba-harness`` by ``harness.lmeval``)."""

    def __init__(self, pretrained=None, mode: str = "fp32", *, mamba_model_path=None, tokenizer=None, plugin=None,
                 modes_file=None, max_length=None, max_gen_toks=None, device=None, batch_size=None,
                 session: EvalSession | None = None, **kwargs) -> None:
        super().__init__()
        calib = {k: kwargs.pop(k) for k in _CALIB_ARGS if k in kwargs}
        kwargs.pop("max_batch_size", None)  # lm-eval always passes these (None where not given)
        kwargs.pop("trust_remote_code", None)
        unknown = sorted(k for k, v in kwargs.items() if v is not None)
        if unknown:
            raise ValueError(f"quamba-harness: unknown model_args {', '.join(unknown)}; valid: pretrained, mode, "
                             f"mamba_model_path, tokenizer, plugin, modes_file, max_length, max_gen_toks, device, "
                             f"batch_size, {', '.join(_CALIB_ARGS)}")
        if session is None and pretrained is None:
            raise ValueError("quamba-harness: model_args must name pretrained=DIR (a float model, or a Quamba "
                             "checkpoint with mamba_model_path=DIR)")
        self.session = session or session_for(session_key(pretrained, mamba_model_path, tokenizer, calib=calib,
                                                          plugin=plugin, modes_file=modes_file))
        dev = "cuda" if str(device or "cpu").startswith("cuda") and torch.cuda.is_available() else "cpu"
        self.model = self.session.emulated(str(mode), dev)  # lm-eval's default cuda, without one: the CPU
        self.mode = self.model.recipe.name
        self.tokenizer_obj = self.session.tokenizer
        bs = str(batch_size or 1)
        self._batch_size = int(bs.split(":")[0]) if not bs.startswith("auto") else 16
        self._max_length = int(max_length) if max_length else DEFAULT_MAX_LENGTH
        self._max_gen_toks = int(max_gen_toks) if max_gen_toks else DEFAULT_MAX_GEN_TOKS

    # --- tokenization (lm-eval's TemplateLM) ---
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer_obj.eos_id
        return 0 if eos is None else int(eos)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tokenizer_obj.tok.encode(string, add_special_tokens=False).ids)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer_obj.tok.decode(list(tokens), skip_special_tokens=False)

    # --- scoring ---
    def _score_batch(self, inputs: list[list[int]], conts: list[list[int]]) -> list[tuple[float, bool]]:
        width = max(len(i) for i in inputs)
        ids = torch.full((len(inputs), width), self.eot_token_id, dtype=torch.int64)
        for row, inp in enumerate(inputs):
            ids[row, :len(inp)] = torch.tensor(inp, dtype=torch.int64)
        logprobs = F.log_softmax(self.model.logits(ids), dim=-1)
        out = []
        for row, (inp, cont) in enumerate(zip(inputs, conts)):
            lp = logprobs[row, len(inp) - len(cont):len(inp)]
            target = torch.tensor(cont, dtype=torch.int64)
            greedy = bool((lp.argmax(-1) == target).all())
            out.append((float(torch.gather(lp, 1, target[:, None]).sum()), greedy))
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None, **kwargs):
        """(logprob, is_greedy) per (key, context_enc, continuation_enc), in the requests' order."""
        prepared = []
        for _, ctx, cont in requests:
            whole = (list(ctx) + list(cont))[-(self.max_length + 1):][:-1]
            prepared.append((whole, list(cont)))
        order = sorted(range(len(prepared)), key=lambda k: -len(prepared[k][0]))
        size = max(1, int(override_bs or self._batch_size))
        results: list[tuple[float, bool] | None] = [None] * len(prepared)
        batch: list[int] = []
        for k in order + [None]:
            same = k is not None and (self.model.pads_safely or not batch or
                                      len(prepared[k][0]) == len(prepared[batch[0]][0]))
            if batch and (k is None or len(batch) >= size or not same):
                scored = self._score_batch([prepared[j][0] for j in batch], [prepared[j][1] for j in batch])
                for j, r in zip(batch, scored):
                    results[j] = r
                batch = []
            if k is not None:
                batch.append(k)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for w in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None,) + w)
                owner.append(n)
        scored = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, scored):
            totals[n] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            until = kw.get("until") or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context)[-(self.max_length - max_new):] or [self.prefix_token_id]
            eot = self.eot_token_id

            def stop(tokens: list[int]) -> bool:
                return tokens[-1] == eot or any(u in self.tok_decode(tokens) for u in until)

            text = self.tok_decode([t for t in self.model.greedy(torch.tensor([ids]), max_new, stop) if t != eot])
            for u in until:
                text = text.split(u)[0]
            out.append(text)
        return out
