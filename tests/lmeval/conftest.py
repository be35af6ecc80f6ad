"""Hermetic lm-eval runs: the datasets and Hub caches in a temporary directory, offline, no bootstrap pool.

Set when this folder is collected, before lm-eval (and with it `datasets`, which reads its cache directory once,
on import) is imported by the tests; removed when the session ends."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

LMEVAL_TMP = Path(tempfile.mkdtemp(prefix="quamba-harness-lmeval-"))
atexit.register(shutil.rmtree, LMEVAL_TMP, True)
os.environ.update(HF_DATASETS_CACHE=str(LMEVAL_TMP / "datasets"), HF_HOME=str(LMEVAL_TMP / "hf"),
                  HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", DISABLE_MULTIPROC="1")
