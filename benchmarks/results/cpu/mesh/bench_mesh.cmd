python benchmarks/bench_mesh.py --rounds 10 --json benchmarks/results/cpu/mesh/bench_mesh.json   # 2-core x86_64 CPU, 8 host devices, shared with other jobs (load ~9), 2026-11-27
