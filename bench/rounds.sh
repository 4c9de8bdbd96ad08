# Rounds of interleaved runs, shared by bench/run-gpu.sh and bench/issue12-gpu.sh (sourced).
# One process's times can sit 20-60% from another's of the same allocator on a shared host,
# so allocators run in rounds, each round's order rotated by one, and bench/report.py pools
# each allocator's per-round ratios to native's run of the same round.

# check_rounds NAME VALUE: exits 2, naming NAME, unless VALUE is a whole number 1 or more.
check_rounds() {
  if ! [[ "$2" =~ ^[1-9][0-9]*$ ]]; then
    echo "$(basename "$0" .sh): $1 must be a whole number of rounds, 1 or more, not '$2'" >&2
    exit 2
  fi
}

# rotated ROUND ITEM...: the items one a line, round r starting at item r-1 (modulo their
# count), so that no item always runs in the same place of a round.
rotated() {
  local r=$1
  shift
  local items=("$@")
  local k=$(((r - 1) % ${#items[@]}))
  printf '%s\n' "${items[@]:k}" "${items[@]:0:k}"
}

# mark_round ROUND FILE: FILE's JSON lines with `"bench_round": ROUND` first (the latency
# benchmark writes its own records; its stitch test's records have a `round` of their own).
mark_round() {
  sed "s/^{/{\"bench_round\":$1,/" "$2"
}
