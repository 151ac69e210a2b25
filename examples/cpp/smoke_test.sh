#!/usr/bin/env bash
# Python-free smoke test of the C runtime's example: smoke_test.sh BUILD_DIR ENGINE_DIR [PROGRAM]
# (BUILD_DIR: a CMake build holding PROGRAM, default trtpaged_generate, or trtpaged_generate_asan;
# ENGINE_DIR: a tiny engine, e.g. examples/tiny.yaml's).
# Checks a batch with a shared prefix and a preemption, determinism, and that bad inputs fail naming the argument.
set -uo pipefail
gen="$1/${3:-trtpaged_generate}"
engine="$2"
fail() { echo "smoke test FAILED: $*" >&2; exit 1; }
ids() { local out="" i; for i in $(seq "$2" "$3"); do out+="$(( (i * $1 + 3) % 300 + 5 )),"; done; echo "${out%,}"; }

shared=$(ids 7 0 47)                                  # 48 tokens: fills max_num_tokens, cached before B arrives
b="$(ids 7 0 39),17,93,5,211,64"                      # shares its first 40 tokens (2 full blocks) with it
out=$("$gen" "$engine" --max-tokens 24 --ignore-eos --stats --num-kv-blocks 8 --max-num-tokens 48 \
      "$shared" "$b" "$(ids 11 0 19)" 1,2,3,4,5) || fail "batch run exited $?"
echo "$out"
[ "$(grep -c '^request [0-3]: .* (length)$' <<<"$out")" = 4 ] || fail "expected 4 finished requests"
while read -r line; do
  n=$(sed 's/^request [0-9]*://; s/(length)//' <<<"$line" | wc -w)
  [ "$n" = 24 ] || fail "expected 24 tokens: $line"
done < <(grep '^request ' <<<"$out")
grep -Eq 'preemptions [1-9]' <<<"$out" || fail "a pool of 8 blocks should force a preemption"
grep -Eq 'prefix_hits_tokens (3[2-9]|[4-9][0-9]|[0-9]{3,})' <<<"$out" || fail "B should reuse 2 cached blocks"

one=$("$gen" "$engine" --max-tokens 8 1,2,3,4,5) || fail "single run exited $?"
two=$("$gen" "$engine" --max-tokens 8 1,2,3,4,5) || fail "second single run exited $?"
[ "$one" = "$two" ] || fail "greedy runs differ: $one / $two"

expect_error() {  # expect_error WHAT TEXT ARGS...: exit status 1 and TEXT on stderr
  local what="$1" text="$2"; shift 2
  local err; err=$("$gen" "$@" 2>&1 >/dev/null); local rc=$?
  [ $rc = 1 ] || fail "$what: exit status $rc, expected 1"
  grep -qF -- "$text" <<<"$err" || fail "$what: expected '$text' in: $err"
  echo "refused as expected ($what): $err"
}
expect_error "missing engine dir" "engine_dir: '/nonexistent/engine' does not exist" /nonexistent/engine 1,2
expect_error "bad token id" "prompt[1]: token id 100000000 is outside the vocabulary" "$engine" 1,100000000
expect_error "too-long prompt" "prompt_len: 600 tokens exceed max_seq_len" "$engine" "$(printf '1,%.0s' $(seq 599))1"
expect_error "pool too small" "options.num_kv_blocks" "$engine" --num-kv-blocks -1 1,2
echo "smoke test passed"
