# One GPU call, no vLLM needed (carry .carry: variants/merge_before from make_baseline.sh, and
# wheels/ with pytest-xdist and execnet): the decode and merge tests on this tree, then the Gluon
# decode with its merge (as the backend launches them) against main's, on the same data.
O=$OUT/merge; mkdir -p $O
B=$PWD/.carry/variants/merge_before
python3 -m pip install -q --no-index --find-links .carry/wheels pytest-xdist >/dev/null 2>&1
PYTHONPATH=$PWD timeout 240 python3 -m pytest -q -p no:warnings -n 14 tests/kernels/test_oscar_attention.py \
  tests/kernels/test_oscar_decode.py > $O/pytest.log 2>&1; echo "rc=$?" >> $O/pytest.log
(cd benchmarks/kernels && PYTHONPATH=$OLDPWD:$B timeout 240 python3 oscar_decode.py against \
  --baseline $B/oscar_decode_before.py --out $O --shapes qwen3-8b --batches 1 8 32 --contexts 1024 4096 8192 32768) \
  > $O/against.log 2>&1
tail -3 $O/pytest.log; grep -v Warn $O/against.log | tail -14
