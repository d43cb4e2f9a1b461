#!/usr/bin/env bash
# The GPU check, in one call on one CUDA GPU; installs nothing, needs no network.
#   1. python lab/bench.py --device=cuda, rows 1-16 (GPU sizes, bf16 autocast, torch.compile row included)
#   2. a short training run of config/paper_44m.py (bf16, compile=True, SDPA flash attention): tokens/s, MFU
#   3. a short training run of config/deeploop_small.py, the 124M-class preset (target: MFU >= 45%)
#   4. Looped-MoE: bench row 17 at config/looped_moe_gpt2s.py's model (MoE / dense step time, grouped_mm vs
#      the per-expert loop, memory, decoding), then a short training run of that preset: tokens/s, MFU
#   5. (STEPS=iso only) the iso-depth law on a reduced grid: d 128/256/384 x budgets 2e14, 6e14 FLOPs x
#      r 1/2/4/8 of the paper's 2 + 16 + 2 blocks, context 256, 8 runs at once on the one GPU, eager; the
#      fit and its report go to $OUT/iso (24 runs + 4 noise runs: the fit may say "not identified", the
#      point is the runs' speed, to size the paper's grid from)
#   6. (STEPS=depth only) continuous depth batching: bench row 18 at d 512 and d 2048, batch 8 and 32
#      (batching.serve and today's batched adaptive decoding against fixed R, fp32), about 2 minutes; then
#      the compiled step (CUDA graphs) on a d 512 and a d 2048 model trained 150 steps on
#      data/shakespeare_char: lab/serve_bench.py --compile at batch 8, 32 and 64 (4B prompts of 14
#      characters from the validation text, 24 new tokens each), fixed-R eager and compiled and depth
#      batching at maxprob >= 0.15 under kv_policy copy, tokens/s, the fraction of the prefill-adjusted
#      bound and the steady state; at batch 1 the memory-bandwidth utilization of fixed-R decoding (needs
#      python prepare.py shakespeare_char; each call within 100 s, about 8 minutes in all)
#   7. (STEPS=lab only) laptop sweeps whose CPU cost is hours, on the GPU in fp32 (TF32 off), several runs
#      at once for LAB_SECONDS (default 360): moe_4x2 (18 runs of 1,000 steps) and matched_pairs (the
#      RMSNorm and penalty arms, 6 runs evaluated at 1,000, 3,000 and 10,000 steps), each compared pair on
#      this one machine. On an H200 the first took 5.5 min for 15 of its runs, the second 2.9 min to 3,000
#      steps (the README of each assets/runs folder). Needs data/shakespeare_char (python prepare.py
#      shakespeare_char). The run folders, less their checkpoints, go to $OUT/lab_runs.tar.gz; a cut-short
#      run resumes from its folder on a later call (bring the folders back under /tmp/lab, checkpoints
#      included)
# The training runs read local data, since the GPU machine has no internet. Prepare it first, on a machine
# that has the network (or pass --input path/to/input.txt), and bring data/ along:
#   python prepare.py shakespeare     # tinyshakespeare in GPT-2 BPE: data/shakespeare, ~300k train tokens
# or your own text:  python prepare.py gutenberg --input path/to/books --tokenizer gpt2  and  DATA=gutenberg.
# The vocabulary comes from the data's meta.json (paper_44m: GPT-2's 50257; deeploop_small and
# looped_moe_gpt2s set 50304).
# Then run, from anywhere, e.g.:  OUT=gpu_out bash lab/gpu_check.sh
# Logs, bench_cuda.json, bench_moe_cuda.json, bench_depth_cuda.json and summary.txt go to $OUT (a relative
# path is taken from the repository root). Each step has its own time limit so one slow step cannot take the
# others' time (560 s in all: the whole script stays under ~9.5 minutes). STEPS picks steps (default: 1-4):
# STEPS=moe bash lab/gpu_check.sh is the Looped-MoE check alone, about 3.5 minutes; STEPS=iso is step 5
# alone, within 5; STEPS=depth is step 6 alone, within 11; STEPS=lab step 7, within LAB_SECONDS (steps
# 5-7 are not in the default: any would take the script past 9.5 minutes).
set -uo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the header above, without running anything
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0
fi
cd "$(dirname "$0")/.."  # the repository root: train.py, config/, data/
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DATA=${DATA:-shakespeare}
STEPS=" ${STEPS:-bench 44m 124m moe} "
want() { [[ "$STEPS" == *" $1 "* ]]; }

{
  date -u '+%Y-%m-%d %H:%M UTC'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(), 'flash sdp', torch.backends.cuda.flash_sdp_enabled())"
  nproc
} 2>&1 | tee "$OUT/env.txt"

# 1. the benchmark table at GPU sizes (writes its JSON after every row, so a timeout keeps what was done);
#    row 17 (Looped-MoE) is step 4's, row 18 (depth batching) step 6's
if want bench; then
  ROWS=$($PY -c "import sys; sys.path.insert(0, 'lab'); import bench; \
print(','.join(name for name in bench.MEASURED if name not in ('moe', 'depth_batching')))")
  timeout 140 $PY lab/bench.py --device=cuda --only="$ROWS" --out="$OUT/bench_cuda.json" 2>&1 \
    | tee "$OUT/bench_cuda.log"
fi

# 2. paper_44m: as configured (batch 64 x 256, K=8 x R=4, per-loop CE), on the local data, 60 iterations
want 44m && timeout 90 $PY train.py config/paper_44m.py --dataset="$DATA" --max_iters=60 \
  --eval_interval=100000 --eval_iters=1 --log_interval=5 --out_dir=/tmp/gpu_out_44m 2>&1 \
  | tee "$OUT/train_44m.log"

# 3. deeploop_small (124M-class: d 768, K=12 x R=3, T=1024): micro-batch 12 as configured, 4 accumulation
#    steps instead of 40 so that an iteration is short, 25 iterations
want 124m && timeout 120 $PY train.py config/deeploop_small.py --dataset="$DATA" \
  --gradient_accumulation_steps=4 --max_iters=25 --eval_interval=100000 --eval_iters=1 --log_interval=1 \
  --warmup_iters=5 --out_dir=/tmp/gpu_out_124m 2>&1 | tee "$OUT/train_124m.log"

# 4. Looped-MoE (GPT-2-small class: d 768, K=8 x R=2, top 2 of 8 experts, T=1024): bench row 17 at that
#    model, then the preset as configured (compile=True; micro-batch 12) with 4 accumulation steps instead
#    of 40, 25 iterations. MFU counts a token's 2 experts and the router (model.flops_per_token)
if want moe; then
  timeout 80 $PY lab/bench.py --device=cuda --only=moe --repeats=5 --out="$OUT/bench_moe_cuda.json" 2>&1 \
    | tee "$OUT/bench_moe_cuda.log"
  timeout 130 $PY train.py config/looped_moe_gpt2s.py --dataset="$DATA" --gradient_accumulation_steps=4 \
    --max_iters=25 --eval_interval=100000 --eval_iters=1 --log_interval=1 --warmup_iters=5 \
    --out_dir=/tmp/gpu_out_moe 2>&1 | tee "$OUT/train_moe.log"
fi

# 5. the iso-depth reduced grid (lab/isodepth.py's runner: a finished run is skipped on a second call)
want iso && timeout 300 $PY lab/isodepth.py --preset=gpu --budgets=2e14,6e14 --widths=128,256,384 \
  --dataset="$DATA" --block_size=256 --batch_size=16 --gradient_accumulation_steps=1 --compile=False \
  --eval_iters=5 --log_interval=100 --workers=8 --starts=100 --resamples=50 --out=/tmp/gpu_iso \
  --report_dir="$OUT/iso" 2>&1 | tee "$OUT/isodepth.log"

# 6. continuous depth batching: bench row 18 at the gpu size (d 512 and d 2048, batch 8 and 32, 4B prompts,
#    24 new tokens each, medians of 3)
want depth && timeout 140 $PY lab/bench.py --device=cuda --only=depth_batching \
  --out="$OUT/bench_depth_cuda.json" 2>&1 | tee "$OUT/bench_depth_cuda.log"
if want depth; then  # the compiled step on trained checkpoints (docs/decoding.md, "The step compiled")
  $PY - <<'EOF'
import array, json
meta = json.load(open('data/shakespeare_char/meta.json'))
ids = array.array('H', open('data/shakespeare_char/val.bin', 'rb').read())
lines = [line for line in ''.join(meta['itos'][i] for i in ids).splitlines() if len(line) >= 14]
open('/tmp/gpu_prompts.txt', 'w').write('\n'.join(lines[-256:]) + '\n')
EOF
  for C in 512 2048; do
    timeout 100 $PY train.py --dataset=shakespeare_char --n_embd=$C --n_head=$((C / 64)) --init=gpt2 \
      --learning_rate=2e-3 --max_iters=150 --lr_decay_iters=150 --eval_interval=150 --eval_iters=2 \
      --dtype=float32 --device=cuda --out_dir=/tmp/gpu_depth_d$C 2>&1 | tail -n 3
    for B in 1 8 32 64; do
      head -n $((B == 1 ? 8 : 4 * B)) /tmp/gpu_prompts.txt > /tmp/gpu_prompts_b$B.txt
      timeout 100 $PY lab/serve_bench.py /tmp/gpu_depth_d$C --prompts=/tmp/gpu_prompts_b$B.txt \
        --prompt_chars=14 --batch_size=$B --max_new_tokens=24 --thresholds=0.15 --kv_policy=copy \
        --repeats=3 --device=cuda --timer=wall --compile 2>&1 | tee "$OUT/serve_compiled_d${C}_b$B.log"
    done
  done
fi

# 7. the lab sweeps on the GPU: both at once, each run a process of its own sharing the one GPU
if want lab; then
  LAB=/tmp/lab
  LAB_SECONDS=${LAB_SECONDS:-360}
  FP32="--device=${LAB_DEVICE:-cuda} --dtype=float32 --compile=False"
  # each sweep on 8 cores of its own (taskset): a run's process drives its kernels from one core
  timeout "$LAB_SECONDS" taskset -c 0-7 $PY lab/ablate.py matched_pairs --workers=6 $FP32 \
    --out=$LAB/matched_pairs --report_dir=$LAB/reports > "$OUT/lab_matched_pairs.log" 2>&1 &
  timeout "$LAB_SECONDS" taskset -c 8-15 $PY lab/ablate.py moe_4x2 --workers=6 $FP32 --out=$LAB/moe_4x2 \
    --report_dir=$LAB/reports > "$OUT/lab_moe_4x2.log" 2>&1 &
  wait
  pkill -f 'train.py|eval_depth.py|lab/moe.py'; sleep 5  # runs that outlived their sweep: saved, stopped
  tar -czf "$OUT/lab_runs.tar.gz" -C "$LAB" --exclude=ckpt.pt --exclude='*.pt' . && ls -la "$OUT"
  tail -n 3 "$OUT/lab_matched_pairs.log" "$OUT/lab_moe_4x2.log"
fi

# summary: medians over the logged iterations after the first five (compilation and warm-up left out)
$PY - "$OUT" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, os, re, statistics, sys
out = sys.argv[1]
for name in ('train_44m', 'train_124m', 'train_moe'):
    rows = []
    try:
        for line in open(os.path.join(out, name + '.log')):
            m = re.match(r"iter (\d+): .*time ([\d.]+)ms, ([\d.]+)k tok/s(?:, mfu ([\d.]+)%)?", line)
            if m and int(m.group(1)) >= 5:
                rows.append((float(m.group(2)), float(m.group(3)), float(m.group(4) or 'nan')))
    except OSError:
        continue  # a step left out (STEPS)
    if rows:
        ms, tok, mfu = (statistics.median(c) for c in zip(*rows))
        print(f"{name}: {len(rows)} iterations, median {ms:.1f} ms/iter, {tok:.1f}k tok/s, MFU {mfu:.1f}%")
    else:
        print(f"{name}: no timed iterations (see {name}.log)")
for name in ('bench_cuda.json', 'bench_moe_cuda.json', 'bench_depth_cuda.json'):
    try:
        print(json.load(open(os.path.join(out, name)))['table'])
    except FileNotFoundError:
        pass  # a step left out (STEPS)
    except (OSError, KeyError, ValueError) as e:
        print(f"{name}: incomplete ({e!r})")
EOF
