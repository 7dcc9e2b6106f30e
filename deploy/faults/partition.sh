#!/bin/sh
# Fault injection for deploy/docker-compose.yml: cut and heal the gossip links between regions.
#
# Each pair of regions gossips over its own Docker network (geolimit-link-A-B), so cutting a
# link is `docker network disconnect`, and healing it `docker network connect` (with the
# agent's service name as alias, so its peers resolve it again). Apps, proxies and each
# region's Redis stay up: a region keeps deciding on what it knows (see the rules' partition
# policies in deploy/config/*/agent.toml), and catches up when the link heals.
#
#   docker compose -f deploy/docker-compose.yml run --rm faults COMMAND     (in a container), or
#   sh deploy/faults/partition.sh COMMAND                                   (docker CLI on the host)
#
# Commands:
#   status          which agent is on which link
#   cut A B         cut the link between regions A and B (a partial partition if both reach C)
#   isolate A       cut both of A's links (A alone on one side)
#   heal A B        restore one link
#   heal            restore every link
#
# Watch it: Grafana's "Gossip lag per peer" and "Outbox per peer", or
#   docker compose -f deploy/docker-compose.yml exec agent-us-east geolimit status \
#     --agent http://127.0.0.1:7411 --token-file /run/secrets/api_token
set -eu

REGIONS="us-east eu-west ap-south"   # the order of the link names
PREFIX=geolimit                      # compose's `name:` and the networks' `name:` prefix

die() { echo "partition.sh: $*" >&2; exit 2; }

check_region() {
    for r in $REGIONS; do [ "$r" = "$1" ] && return 0; done
    die "unknown region '$1' (regions: $REGIONS)"
}

link() {  # link A B: the network of the pair
    check_region "$1"; check_region "$2"
    [ "$1" != "$2" ] || die "a region has no link to itself"
    for r in $REGIONS; do
        if [ "$r" = "$1" ]; then echo "$PREFIX-link-$1-$2"; return 0; fi
        if [ "$r" = "$2" ]; then echo "$PREFIX-link-$2-$1"; return 0; fi
    done
}

agent() { echo "$PREFIX-agent-$1"; }

on_link() {  # on_link NETWORK CONTAINER: is the container attached?
    docker network inspect -f '{{range .Containers}}{{.Name}} {{end}}' "$1" | tr ' ' '\n' | grep -qx "$2"
}

cut() {
    net=$(link "$1" "$2")
    for r in "$1" "$2"; do
        if on_link "$net" "$(agent "$r")"; then
            docker network disconnect "$net" "$(agent "$r")"
        fi
    done
    echo "cut $1 <-> $2"
}

heal_link() {
    net=$(link "$1" "$2")
    for r in "$1" "$2"; do
        if ! on_link "$net" "$(agent "$r")"; then
            docker network connect --alias "agent-$r" "$net" "$(agent "$r")"
        fi
    done
    echo "healed $1 <-> $2"
}

pairs() {  # every pair, once
    rest=$REGIONS
    for a in $REGIONS; do
        rest=${rest#*"$a"}
        for b in $rest; do echo "$a $b"; done
    done
}

status() {
    pairs | while read -r a b; do
        net=$(link "$a" "$b")
        state=up
        for r in "$a" "$b"; do on_link "$net" "$(agent "$r")" || state=CUT; done
        printf '%-22s %s\n' "$a <-> $b" "$state"
    done
}

command=${1:-status}
[ $# -gt 0 ] && shift
case $command in
    status) status ;;
    cut) [ $# -eq 2 ] || die "usage: cut A B"; cut "$1" "$2" ;;
    isolate)
        [ $# -eq 1 ] || die "usage: isolate A"
        check_region "$1"
        for r in $REGIONS; do [ "$r" = "$1" ] || cut "$1" "$r"; done ;;
    heal)
        if [ $# -eq 2 ]; then heal_link "$1" "$2"
        elif [ $# -eq 0 ]; then pairs | while read -r a b; do heal_link "$a" "$b"; done
        else die "usage: heal [A B]"; fi ;;
    -h|--help|help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//' ;;
    *) die "unknown command '$command' (status, cut A B, isolate A, heal [A B])" ;;
esac
