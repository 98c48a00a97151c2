#!/usr/bin/env bash
# Start a local PostgreSQL for the store tests and print the URL to export, e.g.
#
#   export KERNELMILL_TEST_POSTGRES_URL="$(bash .ci/postgres.sh)"
#   export KERNELMILL_REQUIRE_POSTGRES=1   # the PostgreSQL tests then fail instead of skipping
#
# Debian's packages: installs `postgresql` with apt-get when it is missing (needs root), starts the
# cluster (pg_ctlcluster), and creates a role that may create databases (each test gets a fresh one)
# plus a database of its own. Idempotent: running it again reuses the cluster, role and database.
# Everything but the URL goes to stderr.
set -euo pipefail

PGUSER_NAME="${KERNELMILL_PG_USER:-kernelmill}"
PGPASS="${KERNELMILL_PG_PASSWORD:-kernelmill}"
PGDB="${KERNELMILL_PG_DB:-kernelmill_test}"
PGPORT="${KERNELMILL_PG_PORT:-5432}"

log() { echo "postgres.sh: $*" >&2; }
die() { log "$*"; exit 1; }

as_postgres() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        sudo -n -u postgres "$@"
    fi
}

if ! command -v pg_lsclusters >/dev/null 2>&1 || [ -z "$(ls /usr/lib/postgresql/*/bin/postgres 2>/dev/null)" ]; then
    [ "$(id -u)" = 0 ] || die "PostgreSQL is not installed and this is not root: apt-get install postgresql first"
    log "installing Debian's postgresql"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    apt-get install -y -q --no-install-recommends postgresql >&2
fi

version="$(find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -V | tail -n 1)"
[ -n "$version" ] || die "no PostgreSQL server under /usr/lib/postgresql"

if ! pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main"' | grep -q .; then
    log "creating cluster $version/main on port $PGPORT"
    pg_createcluster --port "$PGPORT" "$version" main >&2
fi

cluster_port="$(pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" {print $3}')"
if ! pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" {print $4}' | grep -q online; then
    log "starting cluster $version/main (port $cluster_port)"
    # pg_ctlcluster works without systemd (containers, CI); it runs the server as the postgres user.
    pg_ctlcluster "$version" main start >&2
fi

for _ in $(seq 1 60); do
    if as_postgres pg_isready -q -p "$cluster_port"; then
        break
    fi
    sleep 0.5
done
as_postgres pg_isready -q -p "$cluster_port" || die "the server on port $cluster_port did not come up"

psql_admin() { as_postgres psql -X -q -v ON_ERROR_STOP=1 -p "$cluster_port" -d postgres "$@"; }

# Role: login with a password (scram over TCP on 127.0.0.1), allowed to create the per-test databases.
psql_admin -v name="$PGUSER_NAME" -v pass="$PGPASS" >&2 <<'SQL'
SELECT format('CREATE ROLE %I LOGIN CREATEDB PASSWORD %L', :'name', :'pass')
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'name') \gexec
SELECT format('ALTER ROLE %I LOGIN CREATEDB PASSWORD %L', :'name', :'pass') \gexec
SQL
psql_admin -v name="$PGUSER_NAME" -v db="$PGDB" >&2 <<'SQL'
SELECT format('CREATE DATABASE %I OWNER %I', :'db', :'name')
WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = :'db') \gexec
SQL

url="postgresql+psycopg://${PGUSER_NAME}:${PGPASS}@127.0.0.1:${cluster_port}/${PGDB}"
log "ready: PostgreSQL $version on 127.0.0.1:$cluster_port, database $PGDB, role $PGUSER_NAME"
echo "$url"
