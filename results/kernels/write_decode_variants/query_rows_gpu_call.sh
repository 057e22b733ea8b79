# One GPU call (carry .carry with wheels/: pytest-xdist and execnet; vLLM installed or not: with it,
# write.md has reshape_and_cache_flash beside each row): the decode-write tests, the 32-query-row tile
# among them, then the decode write at 16 and 32 query rows a program, each configuration in two runs.
O=$OUT/query_rows; mkdir -p $O
python3 -m pip install -q --no-index --find-links .carry/wheels pytest-xdist >/dev/null 2>&1
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:warnings -n 14 tests/kernels/test_oscar_write.py \
  -k "decode_write or decode_rotation" > $O/pytest_write.log 2>&1; echo "rc=$?" >> $O/pytest_write.log
for run in 1 2; do
  (cd benchmarks/kernels && PYTHONPATH=$OLDPWD timeout 150 python3 oscar_write.py --out $O/run$run \
    --shapes qwen3-8b smollm2 --tokens 1 8 32 64 128 256 --query-rows 16 32) > $O/bench$run.log 2>&1
done
tail -3 $O/pytest_write.log; cat $O/run2/write.md 2>/dev/null || tail -20 $O/bench2.log
