#!/usr/bin/env bash
# The GPU check, in one call on one CUDA GPU; installs nothing, needs no network.
#   1. python lab/bench.py --device=cuda (GPU sizes, bf16 autocast, torch.compile row included)
#   2. a short training run of config/paper_44m.py (bf16, compile=True, SDPA flash attention): tokens/s, MFU
#   3. a short training run of config/deeploop_small.py, the 124M-class preset (target: MFU >= 45%)
# Both training runs read local data, since the GPU machine has no internet. Prepare it first, on a machine
# that has the network (or pass --input path/to/input.txt), and bring data/ along:
#   python prepare.py shakespeare     # tinyshakespeare in GPT-2 BPE: data/shakespeare, ~300k train tokens
# or your own text:  python prepare.py gutenberg --input path/to/books --tokenizer gpt2  and  DATA=gutenberg.
# The vocabulary comes from the data's meta.json (paper_44m: GPT-2's 50257; deeploop_small sets 50304).
# Then run, from anywhere, e.g.:  OUT=gpu_out bash lab/gpu_check.sh
# Logs, bench_cuda.json and summary.txt go to $OUT (a relative path is taken from the repository root). Each
# step has its own time limit so one slow step cannot take the others' time; the whole script stays under
# ~9 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."  # the repository root: train.py, config/, data/
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DATA=${DATA:-shakespeare}

{
  date -u '+%Y-%m-%d %H:%M UTC'
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(), 'flash sdp', torch.backends.cuda.flash_sdp_enabled())"
  nproc
} 2>&1 | tee "$OUT/env.txt"

# 1. the benchmark table at GPU sizes (writes its JSON after every row, so a timeout keeps what was done)
timeout 220 $PY lab/bench.py --device=cuda --out="$OUT/bench_cuda.json" 2>&1 | tee "$OUT/bench_cuda.log"

# 2. paper_44m: as configured (batch 64 x 256, K=8 x R=4, per-loop CE), on the local data, 60 iterations
timeout 120 $PY train.py config/paper_44m.py --dataset="$DATA" --max_iters=60 --eval_interval=100000 \
  --eval_iters=1 --log_interval=5 --out_dir=/tmp/gpu_out_44m 2>&1 | tee "$OUT/train_44m.log"

# 3. deeploop_small (124M-class: d 768, K=12 x R=3, T=1024): micro-batch 12 as configured, 4 accumulation
#    steps instead of 40 so that an iteration is short, 25 iterations
timeout 160 $PY train.py config/deeploop_small.py --dataset="$DATA" --gradient_accumulation_steps=4 \
  --max_iters=25 --eval_interval=100000 --eval_iters=1 --log_interval=1 --warmup_iters=5 \
  --out_dir=/tmp/gpu_out_124m 2>&1 | tee "$OUT/train_124m.log"

# summary: medians over the logged iterations after the first five (compilation and warm-up left out)
$PY - "$OUT" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, os, re, statistics, sys
out = sys.argv[1]
for name in ('train_44m', 'train_124m'):
    rows = []
    try:
        for line in open(os.path.join(out, name + '.log')):
            m = re.match(r"iter (\d+): .*time ([\d.]+)ms, ([\d.]+)k tok/s(?:, mfu ([\d.]+)%)?", line)
            if m and int(m.group(1)) >= 5:
                rows.append((float(m.group(2)), float(m.group(3)), float(m.group(4) or 'nan')))
    except OSError:
        pass
    if rows:
        ms, tok, mfu = (statistics.median(c) for c in zip(*rows))
        print(f"{name}: {len(rows)} iterations, median {ms:.1f} ms/iter, {tok:.1f}k tok/s, MFU {mfu:.1f}%")
    else:
        print(f"{name}: no timed iterations (see {name}.log)")
try:
    print(json.load(open(os.path.join(out, 'bench_cuda.json')))['table'])
except (OSError, KeyError, ValueError) as e:
    print(f"bench_cuda.json: incomplete ({e!r})")
EOF
