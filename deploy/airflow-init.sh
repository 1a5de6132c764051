#!/usr/bin/env bash
# Prepare Airflow for featurehouse: migrate the metadata database, create the pools the DAGs
# use, and set the admin's password. Idempotent. Run by docker-compose.yml's airflow-init
# service, and by the tests before they start Airflow (so the two cannot drift apart).
set -euo pipefail

airflow db migrate
# Both pools in one `airflow pools import` (each airflow command is ~3 s of start-up): made, or
# their slots and descriptions set again, as `airflow pools set` would.
pools="$(mktemp)"
trap 'rm -f "$pools"' EXIT
python -c 'import json, os, sys
def slots(name, default):
    value = os.environ.get(name) or default
    try:
        return int(value)
    except ValueError:
        sys.exit(f"{name}={value!r} is not a whole number of pool slots")
json.dump({
    "neuronpedia_api": {"slots": slots("FEATUREHOUSE_API_SLOTS", 4), "include_deferred": False,
                        "description": "Fetch tasks calling Neuronpedia at once (they share the nightly rate budget)"},
    "warehouse_writer": {"slots": slots("FEATUREHOUSE_WRITER_SLOTS", 2), "include_deferred": False,
                         "description": "Loads running at once (memory); commits are serialised by the warehouse'"'"'s commit lock, not by this pool"},
}, sys.stdout)' > "$pools"
airflow pools import "$pools"

# The simple auth manager reads users from AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS and their
# passwords from this file (it would invent and print one otherwise).
if [ -n "${AIRFLOW_ADMIN_PASSWORD:-}" ]; then
  file="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE:-${AIRFLOW_HOME:-$HOME/airflow}/simple_auth_manager_passwords.json.generated}"
  mkdir -p "$(dirname "$file")"
  python -c 'import json, os, sys; print(json.dumps({os.environ.get("AIRFLOW_ADMIN_USER", "admin"): os.environ["AIRFLOW_ADMIN_PASSWORD"]}))' > "$file"
  chmod 600 "$file"
fi
