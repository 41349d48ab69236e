#!/usr/bin/env bash
# Everything that needs a real GPU, in one command that ends within ten minutes: for a machine
# with an NVIDIA GPU, CuPy, PyTorch, pytest and pytest-xdist installed (the package itself need
# not be: the repository is put on PYTHONPATH). Run from the repository's root:
#     bash bench/gpu_check.sh [OUTPUT_DIR]        (default: $OUT, else gpu-check/)
# 1. the GPU tests on the GPU (pytest -m gpu, 8 workers; about 30 s on an H200),
# 2. the decoding step's kernels against the CuPy calls they replace (bench/decode_kernels_ab.py),
# 3. bench.py --all --device cuda (float32): its report and raw results go to
#    OUTPUT_DIR/bench/ (RESULTS-cuda.md, results/), so they hold this run's GPU results only;
#    copy them over bench/RESULTS-cuda.md and bench/results/ to keep them.
# Each part has its own time limit, so a slow or hung part leaves the others their time. The
# logs, and a tarball of OUTPUT_DIR/bench (bench-cuda.tgz: one file to fetch), land in
# OUTPUT_DIR; a report that was not written (the part ran out of time) is said so.
set -u -o pipefail
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
status=0

part() {  # part NAME SECONDS COMMAND...: run it, log to OUTPUT_DIR/NAME.log, note its exit code
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "== $name: exit code $rc"
    [ "$rc" -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
part gpu-tests 150 "$py" -m pytest -q -m gpu -n 8 -p no:cacheprovider
part decode-kernels-ab 90 "$py" bench/decode_kernels_ab.py tiny base-lite
mkdir -p "$out/bench"
part bench-cuda 320 "$py" bench/bench.py --all --device cuda --results "$out/bench/RESULTS-cuda.md"
[ -f "$out/bench/RESULTS-cuda.md" ] ||
    { echo "== bench-cuda wrote no report (see bench-cuda.log)"; status=1; }
tar czf "$out/bench-cuda.tgz" -C "$out" bench || status=1
rm -rf "$out/bench"
exit $status
