#!/bin/sh
# Make the secrets deploy/docker-compose.yml mounts at /run/secrets (never committed: see .gitignore).
#   sh deploy/secrets/generate.sh          # creates the missing ones
#   sh deploy/secrets/generate.sh --force  # replaces both (restart every agent, in every region, together)
#
# gossip_key: the HMAC key of the gossip between regions. Every region must have the SAME one
#             (copy this file to every datacenter); at least 16 bytes; 32 random bytes here.
# api_token:  the bearer token of the agents' decision API (Authorization: Bearer <token>).
#             May differ per region; printable ASCII, no spaces.
#
# The folder is 0700 (only you read them on the host); the files are 0644 because compose
# bind-mounts them into containers that run as uid 10001, not as you.
set -eu
cd "$(dirname "$0")"
umask 077
chmod 0700 .
for name in gossip_key api_token; do
    if [ -s "$name" ] && [ "${1:-}" != "--force" ]; then
        echo "keeping $name (use --force to replace it)"
        continue
    fi
    head -c 32 /dev/urandom | base64 | tr -d '\n=' | tr '+/' '-_' >"$name.tmp"
    echo >>"$name.tmp"
    chmod 0644 "$name.tmp"
    mv "$name.tmp" "$name"
    echo "wrote deploy/secrets/$name"
done
