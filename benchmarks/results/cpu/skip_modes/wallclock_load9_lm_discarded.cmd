python benchmarks/bench_skip_modes.py --check --model all --rounds 12 --forms selected guarded dual --json benchmarks/results/cpu/skip_modes/timing_1.json
