#!/usr/bin/env bash
# Validate docker/compose.yaml with Docker Compose; no Docker engine is needed for `config`.
#
# Uses `docker compose` (v2 plugin) when it exists, else `docker-compose` (v1.29 from Debian), and as
# root installs Debian's docker-compose with apt-get when neither is there. The file must stay valid
# for both. Fails when:
#   - compose rejects the file (with docker/.env.example as its .env, its empty secrets filled in);
#   - compose.yaml reads a variable docker/.env.example does not list;
#   - the required secrets (POSTGRES_PASSWORD, KERNELMILL_API_TOKEN) are not enforced when unset or left
#     empty as .env.example leaves them.
set -euo pipefail
cd "$(dirname "$0")"
here="$(pwd)"
file="$here/compose.yaml"
example="$here/.env.example"

compose=()
if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    compose=(docker-compose)
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "check-compose: installing Debian's docker-compose" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    apt-get install -y -q --no-install-recommends docker-compose >&2
    compose=(docker-compose)
else
    echo "check-compose: neither 'docker compose' nor 'docker-compose' is installed (and not root to install it)" >&2
    exit 1
fi
echo "check-compose: $("${compose[@]}" version 2>/dev/null | head -n 1)"

# 1. Every variable the compose file reads, ${VAR} or $VAR, is documented in .env.example ($$ is a literal '$',
#    so $${VAR} is the container shell's own variable, not one compose reads).
missing=0
while read -r var; do
    if ! grep -q "^${var}=" "$example"; then
        echo "check-compose: compose.yaml reads \$$var but docker/.env.example does not set it" >&2
        missing=1
    fi
done < <(grep -oE '[$]+[{]?[A-Za-z_][A-Za-z0-9_]*' "$file" |
    awk '{ n = match($0, /[^$]/) - 1; if (n % 2 == 1) { v = substr($0, n + 1); sub(/^[{]/, "", v); print v } }' |
    sort -u)
[ "$missing" = 0 ]

# Run compose with only the variables of an env file: none inherited from this shell.
run_config() {
    local env_file="$1"
    shift
    env -i PATH="$PATH" HOME="${HOME:-/tmp}" ${DOCKER_CONFIG:+DOCKER_CONFIG="$DOCKER_CONFIG"} \
        "${compose[@]}" --env-file "$env_file" -f "$file" config "$@"
}

secrets=(POSTGRES_PASSWORD KERNELMILL_API_TOKEN)
tmp="$(mktemp)"
filled="$(mktemp)"
trap 'rm -f "$tmp" "$filled"' EXIT

# 2. The file is valid with the example settings, once the secrets it leaves empty are set.
for secret in "${secrets[@]}"; do
    if ! grep -qx "${secret}=" "$example"; then
        echo "check-compose: docker/.env.example must leave $secret empty (a copied secret would be shared)" >&2
        exit 1
    fi
done
sed -e 's/^POSTGRES_PASSWORD=$/POSTGRES_PASSWORD=check-only/' \
    -e 's/^KERNELMILL_API_TOKEN=$/KERNELMILL_API_TOKEN=check-only/' "$example" >"$filled"
run_config "$filled" -q
echo "check-compose: services: $(run_config "$filled" --services | sort | tr '\n' ' ')"

# 3. Without a secret, or with it empty as in .env.example, compose refuses to render it.
for secret in "${secrets[@]}"; do
    grep -v "^${secret}=" "$filled" >"$tmp"
    if run_config "$tmp" -q >/dev/null 2>&1; then
        echo "check-compose: compose.yaml accepted a missing $secret (it must be required)" >&2
        exit 1
    fi
done
if run_config "$example" -q >/dev/null 2>&1; then
    echo "check-compose: compose.yaml accepted the empty secrets of docker/.env.example" >&2
    exit 1
fi
echo "check-compose: docker/compose.yaml is valid"
