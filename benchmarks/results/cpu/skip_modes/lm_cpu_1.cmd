taskset -c 1 python benchmarks/bench_skip_modes.py --clock cpu --model lm --rounds 10 --forms selected guarded dual --json benchmarks/results/cpu/skip_modes/lm_cpu_1.json
