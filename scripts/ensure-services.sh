#!/usr/bin/env bash
# Make sure the PostgreSQL and Redis the tests use are reachable; start the local ones if they
# are installed but stopped. Set TEST_DATABASE_URL / TEST_REDIS_URL to use others instead.
set -euo pipefail

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
redis_up() { (exec 3<>/dev/tcp/127.0.0.1/6379 && printf 'PING\r\n' >&3 && read -r -t 2 line <&3 && [[ $line == +PONG* ]]) 2>/dev/null; }
wait_for() { for _ in $(seq 1 60); do "$1" && return 0; sleep 0.5; done; return 1; }

if [[ -z "${TEST_DATABASE_URL:-}" ]] && ! pg_up; then
  if ls /etc/postgresql >/dev/null 2>&1 && command -v pg_ctlcluster >/dev/null; then
    echo "starting local PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  fi
  wait_for pg_up || { echo "PostgreSQL is not reachable on 127.0.0.1:5432 (set TEST_DATABASE_URL)" >&2; exit 1; }
fi

if [[ -z "${TEST_REDIS_URL:-}" ]] && ! redis_up; then
  if command -v redis-server >/dev/null; then
    echo "starting local Redis"
    mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
  fi
  wait_for redis_up || { echo "Redis is not reachable on 127.0.0.1:6379 (set TEST_REDIS_URL)" >&2; exit 1; }
fi
echo "PostgreSQL and Redis are reachable"
