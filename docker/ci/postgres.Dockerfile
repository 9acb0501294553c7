# Stand-in for `postgres:15` where no registry answers (CI): Debian bookworm's PostgreSQL 15
# behind an entrypoint that honours the official image's POSTGRES_USER, POSTGRES_PASSWORD
# and POSTGRES_DB on first start. Built by docker/build-ci-images.sh.
ARG DEBIAN_IMAGE=kvledger-ci/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-common \
    && echo "create_main_cluster = false" >> /etc/postgresql-common/createcluster.conf \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data \
    LANG=C.UTF-8
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME /var/lib/postgresql/data
EXPOSE 5432
# postgres's "fast" shutdown, as the official image: it does not wait for clients to leave.
STOPSIGNAL SIGINT
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
