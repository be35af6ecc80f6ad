#!/usr/bin/env bash
# Capture layer 0 of every requested mode (thin wrapper of save_first_layer_io.py).
#
#   ./capture_first_layer.sh                  # all: fp32 0 2-0 2-1 2-2 2-3 2-4 3
#   ./capture_first_layer.sh essential        # fp32 0 2-1 2-2 2-4
#   ./capture_first_layer.sh quant_only       # 0 2-0 2-1 2-2 2-3 2-4 3
#   ./capture_first_layer.sh fp32 0 2-1 2-4   # any list of modes
#   ./capture_first_layer.sh essential -- --seq_len 256 --taps all   # options after --
#
# Environment: MODEL (model directory), OUTPUT_FILE, SEQ_LEN, PYTHON.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python=python3; fi
fi

modes=()
while [[ $# -gt 0 && "$1" != "--" ]]; do modes+=("$1"); shift; done
[[ $# -gt 0 ]] && shift  # drop the "--"
[[ ${#modes[@]} -eq 0 ]] && modes=(all)

args=(--modes "${modes[@]}")
[[ -n "${MODEL:-}" ]] && args+=(--model "$MODEL")
[[ -n "${OUTPUT_FILE:-}" ]] && args+=(--output_file "$OUTPUT_FILE")
[[ -n "${SEQ_LEN:-}" ]] && args+=(--seq_len "$SEQ_LEN")

echo "modes: ${modes[*]}"
exec "$python" "$here/save_first_layer_io.py" "${args[@]}" "$@"
