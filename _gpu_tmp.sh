python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:. PREFIXSERVE_COMMIT=$(cat _commit)
python _cmp_route.py 2>&1 | tail -3
timeout 120 python -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe.py -k "route or routing or partials or pdl or direct" 2>&1 | tail -2
cp prefixserve/model/kernels/moe_route.py /tmp/new_route.py
for v in new old new old; do
  if [ $v = old ]; then cp _moe_route_old.py prefixserve/model/kernels/moe_route.py; else cp /tmp/new_route.py prefixserve/model/kernels/moe_route.py; fi
  timeout 150 python -m benchmarks.moe run --parts decode --batches 1 64 --out $OUT/$v-$RANDOM 2>&1 | grep "^{'B'" | sed "s/^/$v /" | cut -c1-120
done
cp /tmp/new_route.py prefixserve/model/kernels/moe_route.py
