# One GPU call, no vLLM needed (carry .carry/variants/before = `git archive f7bd12a csrc_triton benchmarks oscar_vllm`
# unpacked, and .carry/wheels with pytest-xdist and execnet): the decode-write tests on this tree, then
# the write with R as two terms against f7bd12a's three, in graphs of 1, 36 and 2,560.
O=$OUT/two_terms; mkdir -p $O
python3 -m pip install -q --no-index --find-links .carry/wheels pytest-xdist >/dev/null 2>&1
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -p no:warnings -n 14 tests/kernels/test_oscar_write.py \
  -k "decode_write or decode_rotation" > $O/pytest_write.log 2>&1; echo "rc=$?" >> $O/pytest_write.log
PYTHONPATH=$PWD timeout 200 python3 results/kernels/write_decode_variants/two_terms.py \
  .carry/variants/before/csrc_triton/oscar_write.py $O > $O/two_terms.log 2>&1
tail -3 $O/pytest_write.log; grep -v Warn $O/two_terms.log | tail -24
