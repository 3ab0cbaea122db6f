"""The attention benchmark's shapes: Llama-3.1-8B's heads (32 query, 8 KV, d=128), block size 16, and
the grid of batch x shared prefix x own suffix. Shared by the benchmark, its report and ``power.py``."""

HQ, HKV, D, BS = 32, 8, 128, 16
GRID_B = (16, 64, 256, 1024)
GRID_P = (1024, 4096, 16384)
GRID_S = (128, 512)
BASELINE_CAP_BYTES = 40 * 2**30  # materialised per-sequence KV beyond this is reported as null
