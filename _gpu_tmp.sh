python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:. PREFIXSERVE_COMMIT=$(cat _commit)
timeout 330 python -m benchmarks.moe run --out $OUT/moe 2>&1 | grep -v Warning | tail -40
timeout 150 python -m benchmarks.probes.tp_step_profile --tp 1 --model dummy:qwen3-30b-a3b --batch 1 --prefix 64 --own 64 --cuda-only --json $OUT/moe_step_profile_b1.json 2>&1 | tail -25
