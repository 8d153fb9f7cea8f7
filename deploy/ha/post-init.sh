#!/bin/sh
# Patroni's post_bootstrap: once, on the first leader, the application's database.
set -e
psql "$1" -v ON_ERROR_STOP=1 -c "CREATE DATABASE rackplane"
