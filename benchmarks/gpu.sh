#!/usr/bin/env bash
# The GPU figures in docs/performance.md, in one run on a machine with one
# CUDA GPU and jax, optax, flax and jmp installed (the `bench` extra):
#
#   bash benchmarks/gpu.sh OUT_DIR
#
# Each benchmark writes its report to OUT_DIR as it finishes and is cut off
# at its own time limit, so a run stopped early still returns what finished.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: benchmarks/gpu.sh OUT_DIR}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"

bench() { # bench NAME SECONDS ARGS...: one benchmark, its output kept.
    local name="$1" limit="$2"
    shift 2
    echo "== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$py" "$@" 2>&1 | tee "$out/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}

# At most 8 files come back from the lent machines: the GPU's name goes to
# the log only.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
"$py" -c "import jax, optax; print(jax.__version__, optax.__version__, jax.devices())"
# The train step: jls and its peers against plain Adam (the README's table).
# The LM's 16 compiles take most of its time; 5 steps per sample, as the
# small models' 1 ms steps are timed 2 at a time.
bench step_lm 300 benchmarks/bench_step.py --model lm --rounds 10 --steps-per-sample 5
for m in mlp char; do
    bench "step_$m" 90 benchmarks/bench_step.py --model "$m" --rounds 10
done
# The scale statistics' cost against the same fused step without them.
for m in lm mlp char; do
    bench "scale_stats_$m" 80 benchmarks/bench_scale_stats.py --model "$m" --rounds 10
done
# The check alone: its bandwidth against a plain reduction's.
bench all_finite 45 benchmarks/bench_all_finite.py --rounds 15
# The compensated and stochastically rounded steps' kernel counts.
bench low_precision 30 benchmarks/low_precision_params.py --compiled
