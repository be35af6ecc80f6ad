"""Benchmark of lm-eval through the harness (issue 37; targets: fp32 through quamba-harness within 1.5x of lm-eval's
own hf model on the same model and tasks; all modes of `essential` within 1.5x of that many hf runs, calibration
cached).

    .venv/bin/python benchmarks/bench_eval.py                  # shipped model, both local tasks, --limit 20
    .venv/bin/python benchmarks/bench_eval.py --limit 5 --modes fp32 2-1

Every number is the wall time of lm-eval's simple_evaluate on one task (the datasets already prepared, the model
built: a first untimed run does both), median of --repeat runs; the calibration is done before timing (it is in
the cache). "where the time goes" splits quamba-harness's time into the model's forwards (EmulatedLM.logits, the
emulated blocks and head) and the rest (lm-eval's request building and metrics, tokenization, log-softmax).
Results go to benchmarks/eval_results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TMP = Path(tempfile.mkdtemp(prefix="bench-eval-"))
os.environ.update(HF_DATASETS_CACHE=str(TMP / "datasets"), HF_HOME=str(TMP / "hf"), HF_HUB_OFFLINE="1",
                  HF_DATASETS_OFFLINE="1", DISABLE_MULTIPROC="1")
os.environ.setdefault("QUAMBA_HARNESS_CACHE", str(TMP / "cache"))

ESSENTIAL = ["fp32", "0", "2-1", "2-2", "2-4"]


def _timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "mamba-tiny")
    p.add_argument("--tasks", nargs="+", default=["quamba_lastword", "quamba_rolling"])
    p.add_argument("--modes", nargs="+", default=ESSENTIAL)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--calib_data_num", type=int, default=64)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "eval_results.json")
    args = p.parse_args(argv)

    import torch
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    import harness.lmeval  # noqa: F401
    from harness.lmeval.model import QuambaHarnessLM
    from harness.lmeval.session import EmulatedLM
    from harness.lmeval.tasks import write_local_tasks

    tm = TaskManager(include_path=str(write_local_tasks(TMP / "tasks")), include_defaults=False)
    hf = get_model("hf")(pretrained=str(args.model), dtype="float32", device="cpu", batch_size=args.batch_size)
    ours = {m: QuambaHarnessLM(pretrained=str(args.model), mode=m, batch_size=args.batch_size,
                               calib_data_num=args.calib_data_num) for m in args.modes}  # calibrates (cached)
    forward_s = {"t": 0.0}
    plain = EmulatedLM.logits

    def counted(self, ids):
        start = time.perf_counter()
        try:
            return plain(self, ids)
        finally:
            forward_s["t"] += time.perf_counter() - start

    EmulatedLM.logits = counted
    rows = []
    for task in args.tasks:
        def run(lm):
            return simple_evaluate(model=lm, tasks=[task], limit=args.limit, task_manager=tm, bootstrap_iters=0,
                                   log_samples=False, batch_size=args.batch_size, device="cpu")
        run(hf)  # untimed: the dataset prepared, lm-eval's first-call costs paid
        hf_s = _timed(lambda: run(hf), args.repeat)
        for mode, lm in ours.items():
            run(lm)
            forward_s["t"] = 0.0
            s = _timed(lambda: run(lm), args.repeat)
            rows.append({"task": task, "mode": mode, "seconds": round(s, 3), "hf_seconds": round(hf_s, 3),
                         "ratio": round(s / hf_s, 3), "forward_share": round(forward_s["t"] / args.repeat / s, 3)})
            print(f"{task:16s} {mode:5s} {s:8.2f} s   hf {hf_s:8.2f} s   x{s / hf_s:5.2f}   "
                  f"forwards {100 * forward_s['t'] / args.repeat / s:4.0f} %", flush=True)
    total = {t: sum(r["seconds"] for r in rows if r["task"] == t) for t in args.tasks}
    hf_total = {t: next(r["hf_seconds"] for r in rows if r["task"] == t) * len(args.modes) for t in args.tasks}
    summary = {t: {"all_modes_s": round(total[t], 3), "hf_times_modes_s": round(hf_total[t], 3),
                   "ratio": round(total[t] / hf_total[t], 3)} for t in args.tasks}
    for t, v in summary.items():
        print(f"{t}: {len(args.modes)} modes {v['all_modes_s']} s vs {len(args.modes)} hf runs "
              f"{v['hf_times_modes_s']} s: x{v['ratio']}")
    args.out.write_text(json.dumps({"limit": args.limit, "batch_size": args.batch_size, "modes": args.modes,
                                    "torch_threads": torch.get_num_threads(), "rows": rows, "summary": summary},
                                   indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
