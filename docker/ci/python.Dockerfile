# Stand-in for `python:3.11-slim` where no registry answers (CI): Debian bookworm's Python
# 3.11 in a virtual environment first on PATH, so `python` and `pip` work as in the
# official image. The build machine's extra CA certificates are trusted, since pip
# reaches the package index through them. Built by docker/build-ci-images.sh.
ARG DEBIAN_IMAGE=kvledger-ci/debian:bookworm
FROM ${DEBIAN_IMAGE}
COPY ca-certificates/ /usr/local/share/ca-certificates/
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv ca-certificates \
    && update-ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /usr/local/python
ENV PATH=/usr/local/python/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    LANG=C.UTF-8
CMD ["python3"]
