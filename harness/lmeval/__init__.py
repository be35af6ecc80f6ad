"""lm-evaluation-harness for every mode: importing this package registers lm-eval's model ``quamba-harness``
(harness.lmeval.model); ``python -m harness eval`` (harness.lmeval.run) runs modes on tasks and pairs them.

lm-eval is the ``eval`` extra (``pip install 'quamba-harness[eval]'``), imported here only: nothing else in the
harness needs it. Its own models module is imported first, so that lm-eval's built-in models (``hf``, ...) still
resolve after ours is registered.
"""
from __future__ import annotations

import lm_eval.models  # noqa: F401  (lm-eval's built-in model table, before ours joins the registry)
from lm_eval.api.registry import register_model

from .model import QuambaHarnessLM

__all__ = ["QuambaHarnessLM", "MODEL_NAME"]

MODEL_NAME = "quamba-harness"

register_model(MODEL_NAME)(QuambaHarnessLM)
