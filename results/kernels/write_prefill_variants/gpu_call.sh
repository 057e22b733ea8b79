# One GPU call (carry .carry: variants/write_before from make_baseline.sh, wheels/ with pytest-xdist
# and execnet; with vLLM installed, write.md has reshape_and_cache_flash beside each row), on a tree
# with two_terms_prefill.patch applied: the write tests, then the write benchmark at prefill sizes,
# main's kernels ("before") and this tree's ("after") in turn, twice.
O=$OUT/write_prefill; mkdir -p $O
python3 -m pip install -q --no-index --find-links .carry/wheels pytest-xdist >/dev/null 2>&1
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:warnings -n 14 tests/kernels/test_oscar_write.py \
  > $O/pytest_write.log 2>&1; echo "rc=$?" >> $O/pytest_write.log
for round in 1 2; do
  for tree in before after; do
    path=$PWD; [ $tree = before ] && path=$PWD/.carry/variants/write_before:$PWD
    (cd benchmarks/kernels && PYTHONPATH=$path timeout 120 python3 oscar_write.py --out $O/$tree$round \
      --shapes qwen3-8b smollm2 --tokens 2048 8192 16384 --launch table 16x8 32x8) > $O/bench_$tree$round.log 2>&1
  done
done
tail -3 $O/pytest_write.log; for f in $O/before2/write.md $O/after2/write.md; do echo "== $f"; grep "^|" $f; done
