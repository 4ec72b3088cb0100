#!/bin/sh
# One-shot schema step of docker-compose.yml (temporalio/admin-tools image):
# create Temporal's two PostgreSQL databases and bring both schemas up to the
# version this admin-tools release ships. Run it with the same release as the
# temporalio/server image. Safe to run again on an existing volume:
# setup-schema leaves a newer schema version alone and update-schema applies
# only the migrations that are missing.
set -eu

: "${POSTGRES_SEEDS:?POSTGRES_SEEDS (the PostgreSQL host) is required}"
: "${POSTGRES_USER:?POSTGRES_USER is required}"
: "${SQL_PASSWORD:?SQL_PASSWORD (the PostgreSQL password) is required}"
SCHEMA_DIR=/etc/temporal/schema/postgresql/v12

sql() {
  temporal-sql-tool --plugin postgres12 --ep "$POSTGRES_SEEDS" -u "$POSTGRES_USER" -p "${DB_PORT:-5432}" "$@"
}

for pair in temporal:temporal temporal_visibility:visibility; do
  db=${pair%%:*}
  schema=${pair#*:}
  echo "database $db: create (an existing one is kept)"
  sql --db "$db" create || echo "database $db: not created (it exists, or the next step says why)"
  sql --db "$db" setup-schema -v 0.0
  sql --db "$db" update-schema -d "$SCHEMA_DIR/$schema/versioned"
done
echo "PostgreSQL schemas are up to date"
