# A Patroni member: Debian's PostgreSQL 15 and Patroni (the same packages `make ha` runs).
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql-15 patroni python3-etcd \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/patroni && chown postgres:postgres /var/lib/patroni
COPY patroni.yml /etc/patroni.yml
COPY post-init.sh /usr/local/bin/post-init.sh
USER postgres
EXPOSE 5432 8008
CMD ["patroni", "/etc/patroni.yml"]
