#!/usr/bin/env bash
# The deployment's .env, which docker compose reads for every ${...} in docker-compose.yml and
# for COMPOSE_PROFILES: the secrets, made once, and the deployment chosen, kept there so that a
# later `make up` or a plain `docker compose up -d` starts the same one. Run by the Makefile's
# up targets; tests/test_compose.py holds it to the variables docker-compose.yml insists on.
#
#   deploy/dotenv.sh secrets           add the secrets .env lacks (fresh random ones)
#   deploy/dotenv.sh scale-secrets     add MinIO's (the scale profile's S3) credentials
#   deploy/dotenv.sh set KEY=VALUE...  record settings, replacing earlier values
#   deploy/dotenv.sh get KEY           print a recorded setting (empty when none)
set -euo pipefail

file="${DOTENV:-.env}"
python="${PYTHON:-python3}"
umask 077
touch "$file"

has() { grep -q "^$1=" "$file"; }
token() { "$python" -c "import secrets; print(secrets.$1)"; }
add() { has "$1" || echo "$1=$2" >> "$file"; }

case "${1:-}" in
  secrets)
    add AIRFLOW_UID "$(id -u)"
    has AIRFLOW_JWT_SECRET || add AIRFLOW_JWT_SECRET "$(token 'token_hex(32)')"
    has AIRFLOW_ADMIN_PASSWORD || add AIRFLOW_ADMIN_PASSWORD "$(token 'token_urlsafe(12)')"
    if ! has POSTGRES_PASSWORD; then
      # A database volume made before the password moved here was made with the old fixed one:
      # keep it working (rotate it with ALTER USER and this line together, see docs/nightly.md).
      if docker volume inspect "${COMPOSE_PROJECT_NAME:-featurehouse}_postgres-db" >/dev/null 2>&1; then
        echo "POSTGRES_PASSWORD=airflow" >> "$file"
        echo "dotenv: the existing postgres-db volume keeps its old password; rotate it (docs/nightly.md)" >&2
      else
        add POSTGRES_PASSWORD "$(token 'token_urlsafe(24)')"
      fi
    fi
    ;;
  scale-secrets)
    add AWS_ACCESS_KEY_ID featurehouse
    has AWS_SECRET_ACCESS_KEY || add AWS_SECRET_ACCESS_KEY "$(token 'token_urlsafe(24)')"
    ;;
  set)
    shift
    for kv in "$@"; do
      key="${kv%%=*}"
      { grep -v "^${key}=" "$file" || true; echo "$kv"; } > "$file.tmp"
      mv "$file.tmp" "$file"
    done
    ;;
  get)
    { grep "^$2=" "$file" || true; } | tail -n 1 | cut -d= -f2-
    ;;
  *)
    echo "usage: $0 secrets | scale-secrets | set KEY=VALUE... | get KEY" >&2
    exit 2
    ;;
esac
