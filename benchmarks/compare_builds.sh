#!/usr/bin/env bash
# Op time of several builds in one GPU session, the way RESULTS.md's per-version rows compare them.
#
#   benchmarks/compare_builds.sh prepare REV [REV ...]     # here: .compare/<REV>/ from `git archive REV`
#   benchmarks/compare_builds.sh run SPEC [SPEC ...]       # on the GPU: build each tree, then time them
#
# SPEC is TREE or TREE:off, TREE a directory prepared above (.compare/<REV>) or `.` (this working tree); `:off` times
# that tree with issue 46's remedies off (`op_time.py --remedies off`; trees before them have no such option). `run`
# builds the trees in parallel (CUDA_CAPABILITIES, default 9.0), then runs each tree's own benchmarks/op_time.py in
# ROUNDS (default 3) interleaved rounds over SHAPES (default "A C D G P96"), since the GPU's clocks drift within a
# session, then each tree's kernel_times.py over KERNEL_SHAPES (default "A C"). Output under OUT (default
# benchmarks/out/compare): op_time.txt, kernel_times.txt and the build logs. Carry .compare to the GPU machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode=${1:-}
shift || true
case $mode in
  prepare)
    for rev in "$@"; do
      dir=.compare/$rev
      rm -rf "$dir" && mkdir -p "$dir"
      git archive "$rev" | tar -x -C "$dir"
      echo "$dir: $(git rev-parse --short "$rev")"
    done
    ;;
  run)
    python=${PYTHON:-python3}
    out=${OUT:-benchmarks/out/compare}
    mkdir -p "$out"
    export CUDA_CAPABILITIES=${CUDA_CAPABILITIES:-9.0}
    trees=()
    for spec in "$@"; do trees+=("${spec%%:*}"); done
    for tree in $(printf '%s\n' "${trees[@]}" | sort -u); do
      log="$out/build-$(echo "$tree" | tr '/.' '__').log"
      (cd "$tree" && MAX_JOBS=${MAX_JOBS:-4} "$python" scripts/build_local.py >"$log" 2>&1 || echo "build of $tree failed: $log") &
    done
    wait
    tag_of() { local tree=${1%%:*}; [ "$tree" = . ] && tree=working-tree; echo "${tree##*/}${1#"${1%%:*}"}"; }
    options_of() { [ "${1##*:}" = off ] && [ "$1" != "${1%%:*}" ] && echo "--remedies off" || true; }
    for round in $(seq "${ROUNDS:-3}"); do
      for spec in "$@"; do
        # shellcheck disable=SC2046
        "$python" "${spec%%:*}/benchmarks/op_time.py" --min-seconds 0.1 --tag "$(tag_of "$spec")" $(options_of "$spec") \
          ${SHAPES:-A C D G P96} | grep '^op_time' || echo "op_time $(tag_of "$spec") failed"
      done
    done | tee "$out/op_time.txt"
    for spec in "$@"; do
      echo "== $(tag_of "$spec")"
      # shellcheck disable=SC2046
      "$python" "${spec%%:*}/benchmarks/kernel_times.py" $(options_of "$spec") ${KERNEL_SHAPES:-A C} | grep '^kernel_times' ||
        echo "kernel_times $(tag_of "$spec") failed"
    done | tee "$out/kernel_times.txt"
    ;;
  *)
    sed -n '2,12p' "$0" >&2
    exit 2
    ;;
esac
