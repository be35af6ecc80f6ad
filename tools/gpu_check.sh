#!/usr/bin/env bash
# The GPU checks of issue 36 as one script for a lent device machine (docs/gpu.md): the CUDA test module, the
# emulation's scans against mamba_ssm's Triton kernels, the CUDA benchmark and (profile) where its time goes.
# Every result goes to $OUT (or ./gpu-results). Needs: python3 with a CUDA torch; .whl/ holding transformers' wheel
# (carried), .gpu/mamba_ssm (mamba-ssm's source, MAMBA_SKIP_CUDA_BUILD=TRUE: Triton kernels only).
# Usage: bash tools/gpu_check.sh [parity] [kernels] [bench] [profile]   (default: the first three)
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
steps=${*:-kernels parity bench}
{ nvidia-smi -L; python3 -c 'import torch, transformers, sys; print(sys.version.split()[0], torch.__version__,
  torch.version.cuda, transformers.__version__, torch.cuda.get_device_name())'; lscpu | grep "Model name"; } \
  2>&1 | tee "$OUT/machine.txt"
for step in $steps; do
  start=$(date +%s)
  case $step in
    kernels) timeout 100 python3 benchmarks/fidelity_cuda_kernels.py --out "$OUT/results_cuda_kernels.json" ;;
    parity) QUAMBA_CUDA_REPORT=$OUT timeout 200 python3 -m pytest -q -p no:cacheprovider tests/cuda ;;
    bench) timeout 330 python3 benchmarks/bench_cuda.py --runs 1 --n-layer-28 4 --calib 8 512 \
             --out "$OUT/results_cuda.json" ;;
    profile) timeout 200 python3 benchmarks/profile_cuda.py --n-layer 6 --out "$OUT/profile_cuda.json" ;;
  esac > "$OUT/$step.log" 2>&1
  echo "$step: exit $? in $(( $(date +%s) - start )) s"; tail -25 "$OUT/$step.log"
done
