taskset -c 0 python benchmarks/bench_f16_accumulation.py --clock cpu --rounds 15 --warmup 20 --sweep 0 8 15 20 24 --json benchmarks/results/cpu/f16_accumulation/sweep_cpu_1.json
