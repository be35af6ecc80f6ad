#!/usr/bin/env bash
# Capture layer 0 of every requested mode (thin wrapper of save_first_layer_io.py).
#
#   ./capture_first_layer.sh                  # all: fp32 0 2-0 2-1 2-2 2-3 2-4 3
#   ./capture_first_layer.sh essential        # fp32 0 2-1 2-2 2-4
#   ./capture_first_layer.sh quant_only       # 0 2-0 2-1 2-2 2-3 2-4 3
#   ./capture_first_layer.sh fp32 0 2-1 2-4   # any list of modes
#   ./capture_first_layer.sh essential -- --seq_len 256 --taps all   # options after --
#   ./capture_first_layer.sh essential -- --quiet   # no progress, no tables: errors and the file name
#   ./capture_first_layer.sh --help           # the usage and the presets
#
# Environment: MODEL (model directory, or a name inside PRETRAINED_DIR), PRETRAINED_DIR, MAMBA_MODEL_PATH
# (the float model of a quantized Quamba MODEL, as in the research script), OUTPUT_FILE, SEQ_LEN, PYTHON.
#
#   PRETRAINED_DIR=pretrained_models/Quamba1-pa9999/pa-0.9999 MODEL=quamba-130m-w8a8 \
#   MAMBA_MODEL_PATH=pretrained_models/mambaOriginalHuggingfaceDownload ./capture_first_layer.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python=python3; fi
fi

usage() {
    cat <<'EOF'
usage: ./capture_first_layer.sh [MODE|PRESET ...] [-- OPTION ...]

Capture the layer I/O of the given modes (default: all) into one .npz and its _stats.json:
a thin wrapper of save_first_layer_io.py (also: python -m harness capture).

  MODE|PRESET   built-in modes (python -m harness modes lists them with their knobs) or presets:
EOF
    "$python" -c 'import sys; sys.path.insert(0, sys.argv[1]); from harness.modes import PRESETS
for name, modes in PRESETS.items(): print(" " * 16 + name + " = " + " ".join(modes))' "$here" \
        || echo "                (python -m harness modes lists them)"
    cat <<'EOF'
  -- OPTION ... every option after -- is passed to save_first_layer_io.py unchanged
                (./capture_first_layer.sh -- --help lists them), e.g.
                ./capture_first_layer.sh essential -- --seq_len 256 --taps all
  -h, --help    print this and exit

Environment: MODEL (model directory, or a name inside PRETRAINED_DIR), PRETRAINED_DIR,
MAMBA_MODEL_PATH (the float model of a quantized Quamba MODEL), OUTPUT_FILE, SEQ_LEN,
PYTHON (default: .venv/bin/python next to this script, else python3).
EOF
}

modes=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        -*) echo "error: option $1 must come after --, e.g. ./capture_first_layer.sh ${modes[*]:-all} -- $*" >&2
            echo "(./capture_first_layer.sh --help for the usage)" >&2
            exit 2 ;;
    esac
    modes+=("$1"); shift
done
[[ $# -gt 0 ]] && shift  # drop the "--"
[[ ${#modes[@]} -eq 0 ]] && modes=(all)

args=(--modes "${modes[@]}")
[[ -n "${MODEL:-}" ]] && args+=(--model "$MODEL")
[[ -n "${PRETRAINED_DIR:-}" ]] && args+=(--pretrained_dir "$PRETRAINED_DIR")
[[ -n "${MAMBA_MODEL_PATH:-}" ]] && args+=(--mamba_model_path "$MAMBA_MODEL_PATH")
[[ -n "${OUTPUT_FILE:-}" ]] && args+=(--output_file "$OUTPUT_FILE")
[[ -n "${SEQ_LEN:-}" ]] && args+=(--seq_len "$SEQ_LEN")

quiet=0
for a in "$@"; do [[ "$a" == "--quiet" ]] && quiet=1; done
[[ $quiet -eq 0 ]] && echo "modes: ${modes[*]}"  # --quiet: only errors and the file name
exec "$python" "$here/save_first_layer_io.py" "${args[@]}" "$@"
