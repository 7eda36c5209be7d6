taskset -c 1 python benchmarks/bench_skip_modes.py --check --clock cpu --model lm --rounds 10 --forms selected guarded dual substituted --json benchmarks/results/cpu/skip_modes/lm_cpu_2.json
