# attnserve images. Every RUN step calls a script of scripts/ that the test suite runs here
# (tests/deploy checks this), so CI exercises the very steps the images run; scripts/docker-test
# builds the CPU image and runs it (README, Deploy).
#
# BuildKit builds this file (RUN --mount): DOCKER_BUILDKIT=1 with a client that has it (Debian's
# docker.io: /usr/bin/docker; a client without buildx cannot). No "# syntax=" line, so the
# engine's built-in frontend is used and nothing is pulled: the build works offline once the
# base images are there (README: the offline base images).
#
#   DOCKER_BUILDKIT=1 docker build -t attnserve .                 CPU image (Debian bookworm, the
#                                                                 default: the last stage)
#   DOCKER_BUILDKIT=1 docker build --target cuda -t attnserve:cuda .
#                                     CUDA image (NVIDIA CUDA base images, GPU backend for Ampere
#                                     and Hopper: sm_80, sm_90)
#   docker run --rm --read-only -p 127.0.0.1:50051:50051 -p 127.0.0.1:9464:9464 attnserve
#   docker run --rm --gpus all -p 127.0.0.1:50051:50051 -p 127.0.0.1:9464:9464 attnserve:cuda
#
# Arguments after the image name are passed to the server (e.g. --layer NAME=SOURCE); without
# any layer it serves the built-in 'demo' layer.
#
# The CPU target's stages (build, runtime) do not depend on the CUDA ones, and BuildKit builds
# only the stages the target needs, so a CPU build never pulls or builds a CUDA image. Each
# stage copies only what its next RUN needs: scripts/setup alone before the package layer (a
# change anywhere else reuses it), then the sources of the two binaries (not tests/, bench/,
# docs/) before the compile, whose objects stay in a ccache cache mount between builds.

ARG DEBIAN_BUILD_IMAGE=debian:bookworm
ARG DEBIAN_RUNTIME_IMAGE=debian:bookworm-slim
ARG CUDA_VERSION=12.6.3
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
# OCI labels of the runtime images: the version (CMakeLists.txt's project(VERSION), checked by
# tests/deploy), the commit (--build-arg ATTNSERVE_REVISION=$(git rev-parse HEAD)), where the
# sources are (--build-arg ATTNSERVE_SOURCE=URL) and the licence (SPDX; LICENSE).
ARG ATTNSERVE_VERSION=0.1.0
ARG ATTNSERVE_REVISION=unknown
ARG ATTNSERVE_SOURCE=unknown
ARG ATTNSERVE_LICENSES=Apache-2.0

# ---- CUDA build: same scripts, GPU backend on (only for --target cuda) ------------------------
FROM ${CUDA_DEVEL_IMAGE} AS cuda-build
WORKDIR /src
COPY scripts/setup scripts/setup
RUN scripts/setup --build-only
COPY CMakeLists.txt ./
COPY cmake/ cmake/
COPY proto/ proto/
COPY format/ format/
COPY server/ server/
COPY client/ client/
COPY scripts/build scripts/runtime-packages scripts/
# Parallel compile jobs (default: every core); an ARG is in the RUN steps' environment.
ARG ATTNSERVE_JOBS=
# Linked with -s: the runtime image gets stripped binaries.
RUN --mount=type=cache,id=attnserve-ccache-cuda,target=/root/.cache/ccache \
    scripts/build /build \
      -DATTNSERVE_NATIVE=OFF -DATTNSERVE_TESTS=OFF -DATTNSERVE_BENCH=OFF \
      -DATTNSERVE_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=80;90" \
      -DCMAKE_EXE_LINKER_FLAGS=-s -DCMAKE_SHARED_LINKER_FLAGS=-s \
      --target attnserve --target attnserve-cli --target attnserve_cuda_plugin \
 && scripts/runtime-packages /build/server/attnserve /build/server/libattnserve_cuda.so /build/client/attnserve-cli \
      > /build/runtime-packages.txt

# ---- CUDA runtime: NVIDIA's runtime image (CUDA libraries) plus what the binaries link --------
FROM ${CUDA_RUNTIME_IMAGE} AS cuda
RUN --mount=type=bind,source=scripts/setup,target=/tmp/attnserve-setup \
    --mount=type=bind,from=cuda-build,source=/build/runtime-packages.txt,target=/tmp/runtime-packages.txt \
    /tmp/attnserve-setup --runtime-list /tmp/runtime-packages.txt --clean
# The CUDA backend is a plugin the server loads from its own folder.
COPY --from=cuda-build /build/server/attnserve /build/server/libattnserve_cuda.so /build/client/attnserve-cli \
     /usr/local/bin/
COPY scripts/container-entrypoint /usr/local/bin/attnserve-entrypoint
COPY scripts/container-health /usr/local/bin/attnserve-health
ENV ATTNSERVE_TARGET=127.0.0.1:50051 \
    ATTNSERVE_PORT_FILE=/dev/shm/attnserve.port
ARG ATTNSERVE_VERSION
ARG ATTNSERVE_REVISION
ARG ATTNSERVE_SOURCE
ARG ATTNSERVE_LICENSES
LABEL org.opencontainers.image.title="attnserve (CUDA)" \
      org.opencontainers.image.description="gRPC service for multi-head attention layers, CUDA backend" \
      org.opencontainers.image.version="${ATTNSERVE_VERSION}" \
      org.opencontainers.image.revision="${ATTNSERVE_REVISION}" \
      org.opencontainers.image.source="${ATTNSERVE_SOURCE}" \
      org.opencontainers.image.licenses="${ATTNSERVE_LICENSES}"
USER 65532:65532
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["attnserve-health", "--timeout-ms", "4000"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["attnserve-entrypoint", "--device", "cuda"]

# ---- CPU build: scripts/setup --build-only and scripts/build, as scripts/test runs them --------
FROM ${DEBIAN_BUILD_IMAGE} AS build
WORKDIR /src
# The packages first, from scripts/setup alone, so that no other change reinstalls them.
COPY scripts/setup scripts/setup
RUN scripts/setup --build-only
# What the two binaries are built from (tests and benchmarks are off).
COPY CMakeLists.txt ./
COPY cmake/ cmake/
COPY proto/ proto/
COPY format/ format/
COPY server/ server/
COPY client/ client/
COPY scripts/build scripts/build
# Parallel compile jobs (default: every core); an ARG is in the RUN steps' environment.
ARG ATTNSERVE_JOBS=
# Portable code (no -march=native: the image runs on other machines than the one that built it),
# linked with -s (stripped). ccache's objects persist in the cache mount between builds.
RUN --mount=type=cache,id=attnserve-ccache,target=/root/.cache/ccache \
    scripts/build /build \
      -DATTNSERVE_NATIVE=OFF -DATTNSERVE_TESTS=OFF -DATTNSERVE_BENCH=OFF -DATTNSERVE_CUDA=OFF \
      -DCMAKE_EXE_LINKER_FLAGS=-s \
      --target attnserve --target attnserve-cli

# ---- CPU runtime (the default target): the shared libraries only, non-root -------------------
FROM ${DEBIAN_RUNTIME_IMAGE} AS runtime
RUN --mount=type=bind,source=scripts/setup,target=/tmp/attnserve-setup \
    /tmp/attnserve-setup --runtime --clean
COPY --from=build /build/server/attnserve /build/client/attnserve-cli /usr/local/bin/
# The entrypoint passes --port-file $ATTNSERVE_PORT_FILE; the health check reads it.
COPY scripts/container-entrypoint /usr/local/bin/attnserve-entrypoint
COPY scripts/container-health /usr/local/bin/attnserve-health
# The CLI's default target, for `docker exec ... attnserve-cli layers` and the health check
# where there is no port file; the port file on /dev/shm, a tmpfs even on a read-only root.
ENV ATTNSERVE_TARGET=127.0.0.1:50051 \
    ATTNSERVE_PORT_FILE=/dev/shm/attnserve.port
# Declared here, after the RUN steps: a new revision changes the labels, not the layers above.
ARG ATTNSERVE_VERSION
ARG ATTNSERVE_REVISION
ARG ATTNSERVE_SOURCE
ARG ATTNSERVE_LICENSES
LABEL org.opencontainers.image.title="attnserve" \
      org.opencontainers.image.description="gRPC service for multi-head attention layers" \
      org.opencontainers.image.version="${ATTNSERVE_VERSION}" \
      org.opencontainers.image.revision="${ATTNSERVE_REVISION}" \
      org.opencontainers.image.source="${ATTNSERVE_SOURCE}" \
      org.opencontainers.image.licenses="${ATTNSERVE_LICENSES}"
# A numeric non-root user, so Kubernetes' runAsNonRoot can verify it.
USER 65532:65532
# gRPC (--listen) and Prometheus metrics (--metrics-listen): the server's defaults.
EXPOSE 50051 9464
# The standard gRPC health protocol on the server's own port (from the port file, so
# `--listen 0.0.0.0:6000` is followed): SERVING once the layers are loaded and the port is
# bound, NOT_SERVING while draining after SIGTERM.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["attnserve-health", "--timeout-ms", "4000"]
# SIGTERM starts the graceful drain (--drain-timeout-s); give `docker stop -t` more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["attnserve-entrypoint"]
