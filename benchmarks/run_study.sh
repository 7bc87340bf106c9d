#!/usr/bin/env bash
# The paper's comparison, run so that it can be trusted (issue 18): the bundled docstring pairs at full size
# (13,588 pairs), k=20, global batch 64, 2 epochs, arms clustered / random / random_clusters, 3 seeds each,
# for two students that learn: the from-scratch recipe (BERT 2 x 128, mean pooling, lr 4e-4 -> 4e-5, tau 0.05;
# see "Why CLS from scratch collapses" in RESULTS.md) and the bundled MiniLM-L6 fine-tuned. Every arm trains the
# same steps on the same shards and is evaluated on the same held-out queries; report.md of each run holds the
# seed-paired differences with 95% intervals (clustered - random, clustered - random_clusters) and the loss and
# hardness curves. Run it alone on a quiet box (it is hours of CPU on a 2-core machine: the scratch student
# ~30 min, MiniLM ~3 h) and record `uptime` with the figures:
#   bash benchmarks/run_study.sh [OUT_DIR] [scratch|minilm|both|minilm-new|minilm-new-evaluate|minilm-new-verify]
#   (log: OUT_DIR/study.log)
# minilm-new: issue 30's five arms (random, clustered and the three new ones) for MiniLM. The bundled dataset is
# harvested from the installed packages' docstrings, so it changes with their versions (the ef13e37 study's 13,588
# rows are not this install's): arms are paired only within one run directory, never across harvests.
# RESULTS.md's tables come from the run's own summary: python benchmarks/study_table.py OUT_DIR/minilm.
# It can be run in pieces: rerun the same command and compare skips the finished arms, and an arm stopped
# midway resumes from its last checkpoint (every 50 steps) on the same batches.
# Issue 30 (what each hour of preprocessing buys) adds three arms: curriculum (each batch from one cluster with a
# probability rising 0 -> 0.5 over the run, else random), random+mined and clustered+mined (1 mined negative per
# query, joining the loss after the first epoch: the easy-first recipe, train.negatives_curriculum_steps=EASY_STEPS
# ~ one epoch of 12,887 pairs / 64). The scratch student runs them with random and clustered over 5 seeds (seeds
# 0-2 of random and clustered are reused); MiniLM runs them with random and clustered over 3 seeds (minilm-new).
# compare mines once for every arm and seed.
# Over several machines (each session's box is new; the MiniLM study is ~4 h of training here): stop the study
# between arms (Ctrl-C), then `bash benchmarks/run_study.sh OUT_DIR minilm-new-evaluate` evaluates the finished
# arms with compare's own configs, and `python benchmarks/study_state.py save OUT_DIR/minilm STATE.tar.gz` keeps
# their results (no weights). The preprocessing is the same row for row only on the same kind of CPU (two boxes with
# different CPUs put some rows in other clusters), so the next arms train on a carried one, PRE.tar.gz, saved once with
# `study_state.py save-preprocessing OUT_DIR/minilm PRE.tar.gz`. On the next machine: `python
# benchmarks/study_state.py restore STATE.tar.gz OUT_DIR/minilm --preprocessing PRE.tar.gz`, this script with
# minilm-new again, and, once its log shows the first `== compare:`, `bash benchmarks/run_study.sh OUT_DIR
# minilm-new-verify` (every seed's arms must share one preprocessing). benchmarks/results/study/minilm/ holds the
# finished study (3 seeds x 5 arms: compare.json, report.md); its state (arms.tar.gz, and preprocessing.tar.gz of
# seeds 1 and 2) is in git history up to 2ab6e02 (`git show 2ab6e02:benchmarks/results/study30_minilm/arms.tar.gz`).
# The cost table (quality against preprocessing and training cost):  python benchmarks/study_table.py OUT_DIR/<student>
set -euo pipefail
OUT=${1:-runs/study}
WHICH=${2:-both}
mkdir -p "$OUT"
COMMON=(data.limit=null cluster.k=20 train.steps=null train.epochs=2 train.global_batch_size=64
        train.log_every_steps=10 train.checkpoint_every_steps=50 eval.max_queries=1000 eval.num_distractors=5000)
SCRATCH=(train.init=scratch train.tokenizer=bundled train.scratch_hidden_size=128 train.scratch_num_layers=2
         train.scratch_num_heads=2 train.scratch_intermediate_size=512 train.lr=4e-4 train.final_lr=4e-5
         train.temperature=0.05 train.warmup_steps=30)
MINILM=(train.init=bundled train.lr=1e-4 train.final_lr=1e-5 train.warmup_steps=20 train.passage_max_length=64)
EASY_STEPS=200
NEW_ARMS=curriculum,random+mined,clustered+mined
EASY=(--arm "random+mined:train.negatives_curriculum_steps=$EASY_STEPS"
      --arm "clustered+mined:train.negatives_curriculum_steps=$EASY_STEPS")
{
  date -u; uptime
  if [[ $WHICH == scratch || $WHICH == both ]]; then
    time clusterscale compare --run-dir "$OUT/scratch" --arms "random,clustered,$NEW_ARMS" "${EASY[@]}" --seeds 5 \
      --set "${COMMON[@]}" "${SCRATCH[@]}"
    clusterscale report --run-dir "$OUT/scratch"
  fi
  if [[ $WHICH == minilm-new ]]; then  # issue 30's five arms; seed-major, so a run in pieces has whole seeds
    time clusterscale compare --run-dir "$OUT/minilm" --arms "random,clustered,$NEW_ARMS" "${EASY[@]}" \
      --seeds 3 --set "${COMMON[@]}" "${MINILM[@]}"
    clusterscale report --run-dir "$OUT/minilm"
  fi
  if [[ $WHICH == minilm-new-evaluate ]]; then  # the arms finished so far, as the final compare will see them
    python "$(dirname "$0")/study_state.py" evaluate "$OUT/minilm" -- --arms "random,clustered,$NEW_ARMS" "${EASY[@]}" \
      --seeds 3 --set "${COMMON[@]}" "${MINILM[@]}"
  fi
  if [[ $WHICH == minilm-new-verify ]]; then  # the restored arms against this run dir's preprocessing, per seed
    python "$(dirname "$0")/study_state.py" verify "${STUDY_STATE:?STUDY_STATE=arms.tar.gz (git show 2ab6e02:benchmarks/results/study30_minilm/arms.tar.gz)}" \
      "$OUT/minilm" -- --arms "random,clustered,$NEW_ARMS" "${EASY[@]}" --seeds 3 --set "${COMMON[@]}" "${MINILM[@]}"
  fi
  if [[ $WHICH == minilm || $WHICH == both ]]; then
    time clusterscale compare --run-dir "$OUT/minilm" --arms "clustered,random,random_clusters,$NEW_ARMS" "${EASY[@]}" \
      --seeds 3 --set "${COMMON[@]}" "${MINILM[@]}"
    clusterscale report --run-dir "$OUT/minilm"
  fi
  date -u; uptime
} 2>&1 | tee -a "$OUT/study.log"
