#!/usr/bin/env bash
# Builds every fuzz target (cargo-fuzz, libFuzzer) and runs each for SECONDS, one after the other; prints
# executions per target and fails when a target found a crash (the input is kept in fuzz/artifacts/).
#
#   bash fuzz/run.sh SECONDS [TARGET...]     (make fuzz: 120 s per target; make fuzz-smoke: 12 s)
#
# FUZZ_BUILD_FLAGS (default `-O -a -s none`): release build with debug assertions and overflow checks, no
# sanitizer, which works on a stable toolchain (the crate has no `unsafe`; `-s address` needs nightly:
# CARGO="cargo +nightly" FUZZ_BUILD_FLAGS="-O -a -s address"). The corpus grows in fuzz/corpus/<target>
# across runs; fuzz/dicts/<target>.dict is used when there is one; capi_json is seeded with
# tests/fixtures/objects. A crash reproduces with `cargo fuzz run -O -a -s none <target> <artifact>`.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:?usage: fuzz/run.sh SECONDS [TARGET...]}
shift
cargo=${CARGO:-cargo}
build_flags=${FUZZ_BUILD_FLAGS:--O -a -s none}

if ! $cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: cargo-fuzz is not installed: cargo install cargo-fuzz --locked" >&2
  exit 2
fi
# fuzz/ is a workspace of its own; its lock starts from the provider's locked versions.
[ -f fuzz/Cargo.lock ] || cp Cargo.lock fuzz/Cargo.lock

started=$(date +%s)
# shellcheck disable=SC2086
$cargo fuzz build $build_flags
echo "fuzz: built in $(($(date +%s) - started))s"

if [ $# -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <($cargo fuzz list)
fi
triple=$(rustc -vV | sed -n 's/^host: //p')
bin_dir=fuzz/target/$triple/release
log_dir=fuzz/target/logs
mkdir -p "$log_dir"

summary=()
failed=()
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  args=(-max_total_time="$seconds" -timeout=10 -print_final_stats=1 -artifact_prefix="fuzz/artifacts/$t/")
  [ -f "fuzz/dicts/$t.dict" ] && args+=(-dict="fuzz/dicts/$t.dict")
  seeds=()
  [ "$t" = capi_json ] && seeds+=(tests/fixtures/objects)
  log=$log_dir/$t.log
  status=0
  timeout $((seconds + 120)) "$bin_dir/$t" "${args[@]}" "fuzz/corpus/$t" "${seeds[@]}" >"$log" 2>&1 || status=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n1)
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -n1 | cut -d' ' -f2)
  corpus=$(find "fuzz/corpus/$t" -type f | wc -l)
  if [ "$status" -eq 0 ]; then
    result=ok
  else
    result="CRASH (exit $status)"
    failed+=("$t")
    echo "== fuzz: $t found a crash; log $log"
    grep -E "panicked at|^thread|Test unit written|Base64|ERROR: libFuzzer" -A2 "$log" | head -n 30 || tail -n 30 "$log"
  fi
  line=$(printf '%-22s %12s execs %9s/s  cov %5s  corpus %5s  %s' "$t" "${execs:-?}" "${rate:-?}" "${cov:-?}" "$corpus" "$result")
  echo "fuzz: $line"
  summary+=("$line")
done

echo
echo "== fuzz: ${seconds}s per target, $(($(date +%s) - started))s in all"
printf '%s\n' "${summary[@]}"
echo "fuzz: $((${#targets[@]} - ${#failed[@]})) passed, ${#failed[@]} failed"
[ ${#failed[@]} -eq 0 ]
