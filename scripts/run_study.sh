#!/usr/bin/env bash
# The real-code study (docs/BENCHMARKS.md, "The real-code study"): a miniature of the MTPC
# paper's Tables 6-10 on the bundled code target (model=tiny_code, data=python_code), on CPU.
# Trains every cell of configs/experiment/code/ (FF r=1, CP r=8/32, HMM r=32, BTree r=32 at
# n=8 and 16; LoRA k=0/1 at n=16; FF and BTree over 3 seeds; self-distillation at n=8),
# evaluates them greedy and sampling with paired intervals, and merges the seeds:
#   bash scripts/run_study.sh                 # everything (about 2 h on a 2-core CPU)
#   bash scripts/run_study.sh train           # one phase: train | regenerate | eval | report
# The tables land in outputs/eval/code-study/STUDY.md (scripts/study_table.py).
# Every step resumes: training runs resume their folders, evaluations their records, so
# rerunning after an interruption (or with more phases) redoes nothing that is done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
T=outputs/train
E=outputs/eval/code-study
R=outputs/regenerate
ROWS=600   # training rows regenerated for self-distillation (configs/experiment/code/*_regen_*)
EVAL=(model=tiny_code data=python_code num_prompts=10 num_prompt_sets=3 max_new_tokens=128
      max_throughput=false interleave=true plots=false progress=false)
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(train regenerate eval report)

train() { $PY train.py experiment="code/$1" seed="$2" trainer.enable_progress_bar=false; }
draft() { echo "$T/code-$1-s$2/draft"; }   # draft ff-n8-r1-k0-heads 0
join() { local IFS=,; echo "$*"; }

phase_train() {  # the headline first: FF against BTree over three seeds at n = 16
  for cell in ff_n8_r1 btree_n8_r32 ff_n16_r1 btree_n16_r32; do train "$cell" 0; done
  for s in 1 2; do for cell in ff_n16_r1 btree_n16_r32; do train "$cell" "$s"; done; done
  for cell in cp_n8_r8 cp_n8_r32 hmm_n8_r32 cp_n16_r8 cp_n16_r32 hmm_n16_r32; do
    train "$cell" 0
  done
  for s in 1 2; do for cell in ff_n8_r1 btree_n8_r32; do train "$cell" "$s"; done; done
  for cell in ff_n16_r1_lora0 ff_n16_r1_lora1 btree_n16_r32_lora0 btree_n16_r32_lora1; do
    train "$cell" 0
  done
}

phase_regenerate() {  # the target's own answers to the training rows, greedy and at T = 1
  local d; d=$(draft btree-n8-r32-k0-heads 0)
  $PY scripts/regenerate.py model=tiny_code data=python_code data.num_rows=$ROWS \
      max_new_tokens=256 greedy=true draft="$d" progress=false output_dir=$R/code-greedy
  $PY scripts/regenerate.py model=tiny_code data=python_code data.num_rows=$ROWS \
      max_new_tokens=256 greedy=false temperature=1.0 draft="$d" progress=false \
      output_dir=$R/code-t1
  for mode in greedy t1; do  # keep the rows of training files only (eval prompts are held out)
    $PY - "$R/code-$mode" "$R/code-$mode-train" "$ROWS" <<'PY'
import json, sys
from pathlib import Path
from mtpc.data.python_code import is_validation_file, python_code_source
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
rows = list(python_code_source(None, int(sys.argv[3]), 0.05).iter_rows())  # regenerate.py's source
dst.mkdir(parents=True, exist_ok=True)
kept = dropped = 0
with (dst / "rows.jsonl").open("w") as out:
    for shard in sorted(src.glob("shard-*.jsonl")):
        for line in shard.read_text().splitlines():
            row = json.loads(line)
            if is_validation_file(rows[row["regenerated"]["index"]]["file"], 0.1):
                dropped += 1
            else:
                kept += 1
                out.write(line + "\n")
print(f"{dst}: {kept} rows kept, {dropped} rows of held-out files dropped")
PY
  done
  for cell in ff_n8_r1_regen_greedy btree_n8_r32_regen_greedy ff_n8_r1_regen_t1 \
              btree_n8_r32_regen_t1; do
    train "$cell" 0
  done
}

evaluate() {  # evaluate <folder> <baseline> <draft>...
  local out=$1 base=$2; shift 2
  $PY eval.py "${EVAL[@]}" "draft=[$(join "$@")]" baseline="$base" output_dir="$E/$out-greedy"
  $PY eval.py "${EVAL[@]}" "draft=[$(join "$@")]" baseline="$base" greedy=false \
      output_dir="$E/$out-sampling"
}

phase_eval() {
  for s in 0 1 2; do
    local n8=() n16=()
    if [ "$s" = 0 ]; then  # CP and HMM: seed 0 only
      n8=(cp-n8-r8-k0-heads cp-n8-r32-k0-heads hmm-n8-r32-k0-heads)
      n16=(cp-n16-r8-k0-heads cp-n16-r32-k0-heads hmm-n16-r32-k0-heads)
    fi
    local d8=("$(draft ff-n8-r1-k0-heads "$s")" "$(draft btree-n8-r32-k0-heads "$s")")
    for c in "${n8[@]}"; do d8+=("$(draft "$c" "$s")"); done
    local d16=("$(draft ff-n16-r1-k0-heads "$s")" "$(draft btree-n16-r32-k0-heads "$s")")
    for c in "${n16[@]}"; do d16+=("$(draft "$c" "$s")"); done
    evaluate "n8-s$s" "${d8[0]}" "${d8[@]}"
    evaluate "n16-s$s" "${d16[0]}" "${d16[@]}"
  done
  evaluate lora-s0 "$(draft ff-n16-r1-k0-lora 0)" "$(draft ff-n16-r1-k0-lora 0)" \
      "$(draft ff-n16-r1-k1-lora 0)" "$(draft btree-n16-r32-k0-lora 0)" \
      "$(draft btree-n16-r32-k1-lora 0)"
  evaluate selfdistill-s0 "$(draft ff-n8-r1-k0-heads 0)" "$(draft ff-n8-r1-k0-heads 0)" \
      "$(draft btree-n8-r32-k0-heads 0)" "$(draft ff-n8-r1-k0-regen_greedy 0)" \
      "$(draft btree-n8-r32-k0-regen_greedy 0)" "$(draft ff-n8-r1-k0-regen_t1 0)" \
      "$(draft btree-n8-r32-k0-regen_t1 0)"
}

phase_report() {  # FF against BTree over the three seeds
  for w in n8 n16; do
    for m in greedy sampling; do
      $PY eval.py "report=[$(join $E/$w-s0-$m $E/$w-s1-$m $E/$w-s2-$m)]" \
          output_dir="$E/$w-seeds-$m" plots=false
    done
  done
  $PY scripts/study_table.py "$E"   # the docs' tables -> $E/STUDY.md
}

for p in "${phases[@]}"; do  # every phase checked before any work
  case $p in
    train|regenerate|eval|report) ;;
    *) echo "run_study.sh: unknown phase '$p'; allowed: train, regenerate, eval, report" >&2; exit 2 ;;
  esac
done
for p in "${phases[@]}"; do "phase_$p"; done
