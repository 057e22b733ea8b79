# On the CPU machine, from the repository root: main's decode module and its merge kernel as the
# baseline of `oscar_decode.py against` (the decode module imports the merge from oscar_attention;
# the copy imports main's merge instead of this tree's).
set -euo pipefail
B=.carry/variants/merge_before; mkdir -p $B
git show main:csrc_triton/oscar_attention.py > $B/oscar_attention_before.py
git show main:csrc_triton/oscar_decode.py |
  sed 's/^from csrc_triton.oscar_attention import _merge_splits_kernel$/from oscar_attention_before import _merge_splits_kernel/' \
  > $B/oscar_decode_before.py
grep -q "^from oscar_attention_before import _merge_splits_kernel$" $B/oscar_decode_before.py
