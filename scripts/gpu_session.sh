#!/usr/bin/env bash
# One device call made of time-boxed steps (the H200's calls stop at 10 minutes and bring back at most 8 files).
# Usage: JAXATTN_COMMIT=<hash> bash scripts/gpu_session.sh [--by-card] STEPS_FILE... [TOTAL_SECONDS]
#   Several STEPS_FILEs run one after the other in the one call, each step only where its box still fits: a later
#   list's steps fill what the earlier ones' boxes did not use (a skipped step is listed in steps.txt).
#   --by-card: the lists whose "# card:" line names the card this call got run first, the others after, each group in
#   the order given ("# card: h200": the list needs an H200, e.g. its memory; "# card: any": any Hopper card answers
#   it, a record too, with its peers and floor on the same card). On an H200 the h200 lists lead, elsewhere the any
#   lists; a call gets whichever card comes.
#   STEPS_FILE: one step per line, "<seconds> <name> <bash command>" ('#' lines and blank lines skipped), run in order
#   from the checkout's root with what scripts/gpu_env.sh installs, jaxattn on PYTHONPATH and $STEP_OUT a folder for the
#   step's own files (JSON records). A step runs under `timeout <seconds>`; a step that would end past TOTAL_SECONDS
#   (default 560) from the start is skipped, so the packing below always runs. Each step's output goes to
#   <name>.log. Comes back under $OUT: steps.txt (each step's exit status, 124 = its box ran out, and seconds),
#   logs.tgz (every step's log and files) and the first five steps' logs' last 30 KB.
set -uo pipefail
cd "$(dirname "$0")/.."
total=560
by_card=0
steps_files=()
for arg in "$@"; do
  case "$arg" in
    --by-card) by_card=1 ;;
    *[!0-9]*|'') steps_files+=("$arg") ;;
    *) total=$arg ;;  # a bare number: the call's seconds
  esac
done
[ ${#steps_files[@]} -gt 0 ] || { echo "usage: gpu_session.sh STEPS_FILE... [TOTAL_SECONDS]" >&2; exit 2; }
FINAL=${OUT:-$PWD/out}
work=/tmp/gpu_session
rm -rf "$work"  # a warm machine keeps /tmp between calls: logs.tgz holds this call's steps only
mkdir -p "$FINAL" "$work"
source scripts/gpu_env.sh >"$work/install.log" 2>&1 || { cat "$work/install.log"; exit 1; }
start=$SECONDS
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "commit ${JAXATTN_COMMIT:-unknown}, $(date -u +%FT%TZ), ${card:-no GPU seen}" >"$FINAL/steps.txt"
if [ "$by_card" = 1 ]; then
  case "$card" in *H200*) preferred=h200 ;; *) preferred=any ;; esac
  first=() later=()
  for f in "${steps_files[@]}"; do
    if [ "$(sed -n 's/^# card: *//p' "$f" | head -1)" = "$preferred" ]; then first+=("$f"); else later+=("$f"); fi
  done
  steps_files=(${first[@]+"${first[@]}"} ${later[@]+"${later[@]}"})
  echo "lists, $preferred first: ${steps_files[*]}" | tee -a "$FINAL/steps.txt"
fi
while read -r -u 3 seconds name command; do  # fd 3: a step reading stdin must not eat the list
  case "$seconds" in ''|'#'*) continue ;; esac
  if [ $((SECONDS - start + seconds)) -gt "$total" ]; then
    echo "$name skipped (its ${seconds} s would pass the call's ${total} s)" | tee -a "$FINAL/steps.txt"
    continue
  fi
  export STEP_OUT=$work/$name
  mkdir -p "$STEP_OUT"
  began=$SECONDS
  OUT=$STEP_OUT timeout "$seconds" bash -c "$command" >"$work/$name.log" 2>&1 </dev/null
  echo "$name rc=$? ${seconds}s box, took $((SECONDS - began)) s" | tee -a "$FINAL/steps.txt"
  # The log's tail beside logs.tgz, which may come back without it (a step's dumps can pass the size limit).
  [ "$(ls "$FINAL" | wc -l)" -lt 7 ] && tail -c 30000 "$work/$name.log" >"$FINAL/$name.log"
done 3< <(cat "${steps_files[@]}")
# A file comes back only under 16 MB: FlashInfer's JIT cache (gpu_check.sh saves it) stays out, and if the rest is
# still too big, the logs and JSON records alone go.
tar czf "$FINAL/logs.tgz" --exclude=flashinfer.tgz -C "$work" .
if [ "$(stat -c %s "$FINAL/logs.tgz")" -gt 15000000 ]; then  # (PTXAS=1 dumps: gigabytes) the steps' logs and JSON only
  (cd "$work" && find . -maxdepth 2 \( -name '*.log' -o -name '*.json' \) | tar czf "$FINAL/logs.tgz" -T -)
fi
