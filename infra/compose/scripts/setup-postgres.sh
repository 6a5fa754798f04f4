#!/bin/sh
# Temporal's schema on PostgreSQL, for the compose trial (runs in temporalio/admin-tools).
# The steps Temporal's own compose samples run; each one is safe on a database that has them.
set -eu
SQL="temporal-sql-tool --plugin postgres12 --ep postgresql -u temporal -p 5432"
SCHEMA=/etc/temporal/schema/postgresql/v12

echo "waiting for PostgreSQL"
tries=0
until nc -z -w 5 postgresql 5432; do
  tries=$((tries + 1)); [ "$tries" -lt 30 ] || exit 1; sleep 2
done

for db in temporal temporal_visibility; do
  case "$db" in
    temporal) versioned="$SCHEMA/temporal/versioned" ;;
    *) versioned="$SCHEMA/visibility/versioned" ;;
  esac
  $SQL --db "$db" create || echo "database $db exists"
  $SQL --db "$db" setup-schema -v 0.0
  $SQL --db "$db" update-schema -d "$versioned"
done
echo "Temporal schema ready"
