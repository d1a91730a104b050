# PostgreSQL from Debian's packages over the local base (compose.local.yaml), for machines that reach no image
# registry. It reads what the public postgres image reads: POSTGRES_PASSWORD and POSTGRES_DB.
ARG BASE=gyre-base:bookworm
FROM ${BASE}
RUN apt-get update && apt-get install -y --no-install-recommends postgresql \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
COPY postgres-entrypoint.sh /usr/local/bin/
USER postgres
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
ENTRYPOINT ["postgres-entrypoint.sh"]
