# Sourced by the one-call device scripts (bench/device_*.sh): `step CAP CMD...` runs CMD under a timeout of
# CAP seconds or what is left of BUDGET seconds since t0, whichever is less, and skips it when under
# STEP_MIN_S (default 10) are left, so one overrunning step cannot take the rest of a call's budget.
# The caller sets BUDGET and t0=$(date +%s) first.
step() {
    local cap=$1; shift
    local left=$(( BUDGET - ($(date +%s) - t0) ))
    local t=$(( left < cap ? left : cap ))
    if [ "$t" -lt "${STEP_MIN_S:-10}" ]; then echo "== SKIPPED (${left} s left): $*"; return; fi
    echo "== $* (timeout ${t} s, $(( $(date +%s) - t0 )) s in)"
    timeout "$t" "$@"
    echo "== rc=$? after $(( $(date +%s) - t0 )) s"
}
