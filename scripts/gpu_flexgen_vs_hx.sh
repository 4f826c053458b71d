#!/usr/bin/env bash
# FlexGen itself beside hx on the same GPU (issue 38, acceptance F): OPT-6.7B shapes, prompt 512,
# 32 new tokens, FlexGen's published policy for a 16 GB GPU against hx's CP-SAT plan at
# --accelerator-memory 16GB; the throughput of both, in one run.
#
# On the GPU machine, after `bash .gpu/a/stage.sh` (../shared/gpu/README.md; prepare.sh with
# EXTRA_WHEELS="flexgen pulp attrs tqdm" puts FlexGen 0.1.8 beside hx in /tmp/site), from the
# project root:   OUT=<folder> bash scripts/gpu_flexgen_vs_hx.sh
# Needs nothing from .gpu/b. Everything lands in $OUT: summary.txt / summary.json, the logs, and
# flexgen_vs_hx.tgz (the whole work folder). About 4-7 minutes on an H100; every step runs
# under `timeout`, sized from what is left of BUDGET_S (default 480 s), so one hang cannot eat
# the slot, and steps that no longer fit are skipped (said so in the summary).
#
# FlexGen (PyPI flexgen 0.1.8, dummy weights: --path _DUMMY_):
#   python -m flexgen.flex_opt --model facebook/opt-6.7b --path _DUMMY_ --prompt-len 512
#     --gen-len 32 --percent 100 0 100 0 100 0 --gpu-batch-size 2 --overlap False
#   = FlexGen's own policy for OPT-6.7B at prompt 512 / gen 32 on a 16 GB T4:
#   FMInference/FlexiGen benchmark/flexgen/bench_suite.py line 44 (suite "6b7_1x1", the
#   seq_len 512 case; commit d5fdcdc), and benchmark/batch_size_table.md: "FlexGen | 2 (gpu)"
#   for OPT-6.7B, 25.26 token/s on the T4. Weights, KV cache and activations all on the GPU,
#   one GPU batch of 2 sequences. FlexGen does not limit its own memory: here torch's caching
#   allocator is capped at the 16 GB budget (FLEXGEN_CAP, bytes; 0 = no cap), so FlexGen runs
#   in the same 16e9 bytes hx is given. Its tokenizer (`facebook/opt-30b`, from the hub, used
#   only to pad the prompt) is a local stand-in: scripts/flexgen_tokenizer.py, HF_HUB_OFFLINE=1.
#
# hx (random weights of the OPT-6.7B preset, float16 as FlexGen holds them):
#   `hx plan -m opt-6.7b --dtype float16 --accelerator-memory 16GB --policy P --batch B
#    --prompt-tokens 512 --max-new-tokens 32 -o plan.json` picks each plan (CP-SAT prices ops with
#   a hardware profile: /tmp/check/profile.json when check.sh left one on this machine, else
#   the quick one `hx plan` measures itself, <= 20 s); then a few lines of hx's public Python API
#   (hx.load, hx.discover, hx.ExecutionPlan.load, hx.Engine.generate_ids, hx.SamplingParams)
#   run B random 512-token prompts x 32 new tokens as one static batch under that plan. (`hx
#   generate` takes text, which a random-weight preset has no tokenizer for; `hx bench` times
#   decode steps only, at --context, and builds its plans without a profile, so not cpsat.)
#   Plans run, in this order while time is left: cpsat at B; all-accelerator at B (FlexGen's
#   6.7B placement: everything resident on the GPU); cpsat at HX_BIG_BATCH (hx's plan for a
#   larger block under the same 16 GB); flexgen-lp at B (hx's FlexGen-style LP policy).
#
# Throughput = generated tokens / (prefill + decode seconds), as FlexGen's "total throughput"
# (flex_opt.py run_flexgen); both time a second generation after a warm-up one (XLA's GPU
# compilation and autotuning of the decode programs took 15-19 s of a first run on an H200).
#
# OPT-30B is left out: FlexGen's 30B policy (bench_suite.py line 64: --percent 20 80 0 100 0 100
# --gpu-batch-size 48 --num-gpu-batches 3 --cpu) keeps 144 sequences' KV cache (108 GB) and 80 %
# of the weights (48 GB, pinned) in host memory: more than these machines' 128 GiB.
set -u
SITE=${SITE-/tmp/site}            # where stage.sh installed hx and FlexGen ('' = as is)
PY=${PY:-python3}                 # Python for hx (and the tokenizer script)
FG_PY=${FG_PY:-$PY}               # Python for FlexGen
OUT=${OUT:-/tmp/flexgen_vs_hx_out}
BUDGET_S=${BUDGET_S:-480}         # the whole script's seconds
BUDGET=${BUDGET:-16GB}            # hx --accelerator-memory
FLEXGEN_CAP=${FLEXGEN_CAP:-16e9}  # bytes torch may allocate for FlexGen (0: no cap)
PROMPT=${PROMPT:-512}; GEN=${GEN:-32}
BATCH=${BATCH:-2}                 # FlexGen's GPU batch for 6.7B (bench_suite.py:44); hx the same
HX_BIG_BATCH=${HX_BIG_BATCH:-16}  # a larger block for hx's CP-SAT plan (0: skip)
HX_MODEL=${HX_MODEL:-opt-6.7b}; FG_MODEL=${FG_MODEL:-facebook/opt-6.7b}
HX_DTYPE=${HX_DTYPE:-float16}
[ -n "$SITE" ] && export PYTHONPATH=$SITE
export PYTHONUNBUFFERED=1
if [ -n "$SITE" ] && ! { [ -d "$SITE/hx" ] && [ -d "$SITE/flexgen" ]; }; then
  echo "not staged: run .gpu/a/stage.sh (carry .gpu/a, prepared with EXTRA_WHEELS=\"flexgen pulp attrs tqdm\") first"
  exit 1
fi
ROOT=$PWD
W=/tmp/flexgen_vs_hx; rm -rf $W; mkdir -p $W "$OUT"
cd $W  # FlexGen writes its log and offload folder here; hx runs from the installed wheel
START=$SECONDS
log() { echo "== [$((SECONDS - START))s] $*"; echo "$*" >> $W/steps.txt; }
# seconds a step may take: min(its cap, what is left of BUDGET_S less a reserve for the summary)
allow() { local left=$((BUDGET_S - (SECONDS - START) - 25)); [ $left -lt $1 ] && echo $left || echo $1; }
HX=($PY -c 'import sys; from hx.cli import main; sys.argv[0] = "hx"; main()')  # as check.sh

{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import sys, torch, transformers, jax; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'jax', jax.__version__)"
  $PY -c "import hx; print(hx.discover('$BUDGET').describe())"; } > $W/env.txt 2>&1
cat $W/env.txt

# --- FlexGen --------------------------------------------------------------------------------
# The hub is out of reach: FlexGen's AutoTokenizer.from_pretrained("facebook/opt-30b") must
# resolve in a local cache.
export HF_HOME=$W/hf HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
log "tokenizer stand-in"
timeout 60 $PY "$ROOT/scripts/flexgen_tokenizer.py" --hf-home "$HF_HOME" 2>&1 | tail -3

# flex_opt's __main__ under runpy, after capping torch's allocator at FLEXGEN_CAP bytes.
FG=($FG_PY -c '
import runpy, sys
cap = float(sys.argv.pop(1))
if cap > 0:
    try:
        import torch
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        print(f"FlexGen capped at {cap / 2**30:.2f} GiB of {total / 2**30:.2f} GiB", flush=True)
    except Exception as e:
        print(f"no memory cap for FlexGen: {e}", flush=True)
runpy.run_module("flexgen.flex_opt", run_name="__main__", alter_sys=True)')
FG_ARGS=(--model $FG_MODEL --path _DUMMY_ --prompt-len $PROMPT --gen-len $GEN
         --percent 100 0 100 0 100 0 --gpu-batch-size $BATCH --num-gpu-batches 1 --overlap False
         --offload-dir $W/offload)
t=$(allow 240)
log "FlexGen ${FG_ARGS[*]} (cap $FLEXGEN_CAP bytes, timeout ${t}s)"
timeout $t "${FG[@]}" $FLEXGEN_CAP "${FG_ARGS[@]}" --log-file $W/flexgen.log > $W/flexgen.out 2>&1
echo "rc=$?" >> $W/flexgen.out
t=$(allow 200)
if [ ! -s $W/flexgen.log ] && [ "$FLEXGEN_CAP" != 0 ] && [ $t -ge 90 ]; then
  # failed under the cap (out of memory?): once more without it, so FlexGen still has a figure
  log "FlexGen again without the memory cap (timeout ${t}s)"
  mv $W/flexgen.out $W/flexgen-capped.out; FLEXGEN_CAP=0
  timeout $t "${FG[@]}" 0 "${FG_ARGS[@]}" --log-file $W/flexgen.log > $W/flexgen.out 2>&1
  echo "rc=$?" >> $W/flexgen.out
fi
grep -v -E "^\s*$|it/s\]|Warning|warn\(|return isinstance|data_ptr = " $W/flexgen.out | tail -16

# --- hx -------------------------------------------------------------------------------------
PROFILE_ARGS=()
if [ -f "${HX_PROFILE:-/tmp/check/profile.json}" ]; then
  PROFILE_ARGS=(--profile "${HX_PROFILE:-/tmp/check/profile.json}")
fi
echo "profile: ${PROFILE_ARGS[*]:-quick (hx plan measures it)}" >> $W/steps.txt

# One static batch of B random prompts under a plan JSON, through hx's public API; one JSON line.
cat > $W/hx_run.py <<'EOF'
import json, sys, time
import numpy as np
import hx

name, budget, dtype, batch, prompt, new, plan_path, out = sys.argv[1:9]
batch, prompt, new = int(batch), int(prompt), int(new)
t = time.perf_counter()
model = hx.load(name, dtype=dtype)
devices = hx.discover(accelerator_memory=budget)
plan = hx.ExecutionPlan.load(plan_path, model.spec.n_layers)
print(f"{model.spec.name}: {model.source}, loaded in {time.perf_counter() - t:.1f} s | "
      f"{devices.describe()}", flush=True)
ids = np.random.default_rng(0).integers(4, model.spec.vocab_size - 8, (batch, prompt)).tolist()
engine = hx.Engine(model, plan, devices)
engine.generate_ids(ids, hx.SamplingParams(max_new_tokens=new))  # warm-up, as FlexGen's
t = time.perf_counter()
res = engine.generate_ids(ids, hx.SamplingParams(max_new_tokens=new))
wall = time.perf_counter() - t
compile_s = max(r.compile_s for r in res)
run = wall - compile_s
prefill = max(r.ttft_s for r in res)
generated = sum(len(r.token_ids) for r in res)
peak = getattr(engine.accountant, "peak", None)
row = dict(engine="hx", policy=plan.name, plan_file=plan_path, batch=batch, prompt=prompt, gen=new,
           generated=generated, compile_s=round(compile_s, 3), prefill_s=round(prefill, 4),
           decode_s=round(run - prefill, 4), tok_s=round(generated / run, 3),
           peak_acc_gib=None if peak is None else round(peak / 2**30, 3),
           device=devices.describe())
print(json.dumps(row), flush=True)
with open(out, "w") as f:
    json.dump(row, f, indent=1)
EOF

hx_case() {  # policy batch: plan it with the CLI, then run it
  local policy=$1 b=$2 tag=$1-b$2 t
  t=$(allow 150)
  [ $t -lt 30 ] && { log "skip hx $tag: ${t}s left"; return; }
  log "hx plan $policy batch $b (timeout ${t}s)"
  timeout $t "${HX[@]}" plan -m $HX_MODEL --dtype $HX_DTYPE --accelerator-memory $BUDGET \
    --policy $policy --batch $b --prompt-tokens $PROMPT --max-new-tokens $GEN \
    ${PROFILE_ARGS[@]+"${PROFILE_ARGS[@]}"} -o $W/plan-$tag.json > $W/plan-$tag.txt 2>&1
  echo "rc=$?" >> $W/plan-$tag.txt; tail -6 $W/plan-$tag.txt
  [ -f $W/plan-$tag.json ] || return
  t=$(allow 200)
  [ $t -lt 45 ] && { log "skip hx run $tag: ${t}s left"; return; }
  log "hx run $policy batch $b (timeout ${t}s)"
  timeout $t $PY $W/hx_run.py $HX_MODEL $BUDGET $HX_DTYPE $b $PROMPT $GEN $W/plan-$tag.json \
    $W/hx-$tag.json > $W/hx-$tag.out 2>&1
  echo "rc=$?" >> $W/hx-$tag.out; tail -4 $W/hx-$tag.out
}
hx_case cpsat $BATCH
hx_case all-accelerator $BATCH
[ "$HX_BIG_BATCH" -gt 0 ] && hx_case cpsat $HX_BIG_BATCH
hx_case flexgen-lp $BATCH

# --- summary --------------------------------------------------------------------------------
$PY - "$W" "$BATCH" "$PROMPT" "$GEN" "$FLEXGEN_CAP" > $W/summary.txt <<'EOF'
import glob, json, os, re, sys
w, batch, prompt, gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cap = float(sys.argv[5])
fg_out = os.path.join(w, "flexgen.out")
if os.path.exists(fg_out) and "no memory cap for FlexGen" in open(fg_out).read():
    cap = 0.0  # setting the cap failed (the message is in flexgen.out)
rows = []
text = open(os.path.join(w, "flexgen.log")).read() if os.path.exists(
    os.path.join(w, "flexgen.log")) else ""
num = lambda key: (lambda m: float(m.group(1)) if m else None)(
    re.search(key + r":\s*([0-9.]+)", text))
if text:
    rows.append(dict(engine="FlexGen 0.1.8", policy="100 0 100 0 100 0", batch=batch,
                     prefill_s=num("prefill latency"), decode_s=num("decode latency"),
                     tok_s=num("total throughput"), peak_acc_gib=num("peak gpu mem"),
                     decode_tok_s=num("decode throughput"),
                     cap_gib=round(cap / 2**30, 2) if cap > 0 else None))
else:
    out = os.path.join(w, "flexgen.out")
    lines = open(out).read().strip().splitlines() if os.path.exists(out) else ["not run"]
    said = [l for l in lines if l.strip() and not l.startswith("rc=")]
    rc = [l for l in lines if l.startswith("rc=")]
    rows.append(dict(engine="FlexGen 0.1.8", policy="100 0 100 0 100 0", batch=batch,
                     error=" ".join(rc[-1:] + said[-1:])[:300] or "no output"))
for path in sorted(glob.glob(os.path.join(w, "hx-*.json")), key=os.path.getmtime):
    row = json.load(open(path))
    # hx plan's own prediction of the run (the simulator on the profile), for reference
    plan_txt = row.get("plan_file", "")[:-5] + ".txt"
    m = os.path.exists(plan_txt) and re.search(
        r"run \(prefill, then \d+ decode steps\) ([0-9.]+) s", open(plan_txt).read())
    row["predicted_tok_s"] = round(row["batch"] * gen / float(m.group(1)), 2) if m else None
    rows.append(row)
fmt = lambda v, f: "-" if v is None else format(v, f)
print(f"{'engine':14} {'policy':18} {'batch':>5} {'prefill s':>9} {'decode s':>9} "
      f"{'tokens/s':>9} {'peak GiB':>8} {'predicted':>9}")
for r in rows:
    if "error" in r:
        print(f"{r['engine']:14} {r['policy']:18} {r['batch']:>5}  failed: {r['error']}")
        continue
    print(f"{r['engine']:14} {r['policy']:18} {r['batch']:>5} {fmt(r['prefill_s'], '9.3f')} "
          f"{fmt(r['decode_s'], '9.3f')} {fmt(r['tok_s'], '9.2f')} "
          f"{fmt(r.get('peak_acc_gib'), '8.2f')} {fmt(r.get('predicted_tok_s'), '9.2f')}")
print(f"tokens/s = {gen} new tokens x batch / (prefill + decode), prompt {prompt}; each "
      "timed after a warm-up generation; peak: torch max_memory_allocated "
      "(FlexGen), hx's memory accountant (hx); predicted: hx plan's simulator for the same run")
print(f"FlexGen's torch allocator capped at {cap:.3g} bytes ({cap / 2**30:.2f} GiB)" if cap > 0
      else "FlexGen ran without a memory cap")
json.dump(rows, open(os.path.join(w, "summary.json"), "w"), indent=1)
EOF
cat $W/env.txt $W/steps.txt >> $W/summary.txt
echo "== summary ($((SECONDS - START)) s)"; head -9 $W/summary.txt
cp $W/summary.txt $W/summary.json $W/env.txt $W/flexgen*.out "$OUT"/ 2>/dev/null
tar czf "$OUT"/flexgen_vs_hx.tgz --exclude=offload --exclude=hf -C $W .
