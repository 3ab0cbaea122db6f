set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:. PREFIXSERVE_COMMIT=$(cat _commit)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python -m benchmarks.probes.moe_tiles --direct --batches 1 2 --json $OUT/moe_tiles_direct.json 2>&1 | grep -v Warning | tail -30
timeout 230 python -m pytest -q -p no:cacheprovider -x tests/kernels/test_fused_moe.py tests/test_moe_families_gpu.py 2>&1 | tail -5
