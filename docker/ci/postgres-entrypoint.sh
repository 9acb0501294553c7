#!/bin/sh
# First start: create the cluster with POSTGRES_USER (default postgres) as superuser and
# POSTGRES_PASSWORD as its password, and POSTGRES_DB (default: the user's name). Then run
# the command as the postgres OS user. Local socket connections are trusted, TCP ones
# need the password, as in the official image.
set -eu

if [ "${1:-}" != postgres ]; then
  exec "$@"
fi

if [ "$(id -u)" = 0 ]; then
  mkdir -p "$PGDATA" /var/run/postgresql
  chown -R postgres:postgres "$PGDATA" /var/run/postgresql
  chmod 700 "$PGDATA"
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi

user=${POSTGRES_USER:-postgres}
database=${POSTGRES_DB:-$user}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "POSTGRES_PASSWORD is not set; the database would accept anyone" >&2
    exit 1
  fi
  password_file=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$password_file"
  initdb -D "$PGDATA" -U "$user" --pwfile="$password_file" -E UTF8 --locale=C.UTF-8 \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$password_file"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
  if [ "$database" != postgres ]; then
    echo "CREATE DATABASE \"$database\" OWNER \"$user\"" | postgres --single -D "$PGDATA" postgres >/dev/null
  fi
fi
exec "$@"
