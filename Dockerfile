# syntax=docker/dockerfile:1
# attnserve images. Every RUN step calls a script of scripts/ that the test suite runs here
# (tests/deploy checks this), so CI exercises the very steps the images run.
#
#   docker build -t attnserve .                         CPU image (Debian bookworm, the default)
#   docker build --target cuda -t attnserve:cuda .      CUDA image (NVIDIA CUDA base images,
#                                                       GPU backend for Ampere and Hopper: sm_80, sm_90)
#   docker run --rm -p 50051:50051 -p 9464:9464 attnserve
#   docker run --rm --gpus all -p 50051:50051 -p 9464:9464 attnserve:cuda
#
# Arguments after the image name are passed to the server (e.g. --layer NAME=SOURCE); without
# any layer it serves the built-in 'demo' layer.

ARG DEBIAN_BUILD_IMAGE=debian:bookworm
ARG DEBIAN_RUNTIME_IMAGE=debian:bookworm-slim
ARG CUDA_VERSION=12.6.3
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04

# ---- CUDA build: same scripts, GPU backend on -------------------------------------------------
FROM ${CUDA_DEVEL_IMAGE} AS cuda-build
WORKDIR /src
COPY scripts/ scripts/
RUN scripts/setup --no-fetch
COPY . .
# Parallel compile jobs (default: every core); an ARG is in the RUN steps' environment.
ARG ATTNSERVE_JOBS=
RUN --mount=type=cache,target=/root/.cache/ccache \
    scripts/build /build \
      -DATTNSERVE_NATIVE=OFF -DATTNSERVE_TESTS=OFF -DATTNSERVE_BENCH=OFF \
      -DATTNSERVE_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=80;90" \
      --target attnserve --target attnserve-cli --target attnserve_cuda_plugin \
 && scripts/runtime-packages /build/server/attnserve /build/server/libattnserve_cuda.so /build/client/attnserve-cli \
      > /build/runtime-packages.txt

# ---- CUDA runtime: NVIDIA's runtime image (CUDA libraries) plus what the binaries link --------
FROM ${CUDA_RUNTIME_IMAGE} AS cuda
RUN --mount=type=bind,source=scripts,target=/tmp/attnserve-scripts \
    --mount=type=bind,from=cuda-build,source=/build/runtime-packages.txt,target=/tmp/runtime-packages.txt \
    /tmp/attnserve-scripts/setup --runtime-list /tmp/runtime-packages.txt --clean
# The CUDA backend is a plugin the server loads from its own folder.
COPY --from=cuda-build /build/server/attnserve /build/server/libattnserve_cuda.so /build/client/attnserve-cli \
     /usr/local/bin/
ENV ATTNSERVE_TARGET=127.0.0.1:50051
USER 65532:65532
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["attnserve-cli", "--timeout-ms", "4000", "health"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["attnserve", "--device", "cuda"]

# ---- CPU build: scripts/setup and scripts/build, as scripts/test runs them --------------------
FROM ${DEBIAN_BUILD_IMAGE} AS build
WORKDIR /src
# The packages first, so that a source change does not reinstall them.
COPY scripts/ scripts/
RUN scripts/setup --no-fetch
COPY . .
# Parallel compile jobs (default: every core); an ARG is in the RUN steps' environment.
ARG ATTNSERVE_JOBS=
# Portable code (no -march=native: the image runs on other machines than the one that built it).
RUN --mount=type=cache,target=/root/.cache/ccache \
    scripts/build /build \
      -DATTNSERVE_NATIVE=OFF -DATTNSERVE_TESTS=OFF -DATTNSERVE_BENCH=OFF -DATTNSERVE_CUDA=OFF \
      --target attnserve --target attnserve-cli

# ---- CPU runtime (the default target): the shared libraries only, non-root -------------------
FROM ${DEBIAN_RUNTIME_IMAGE} AS runtime
RUN --mount=type=bind,source=scripts,target=/tmp/attnserve-scripts \
    /tmp/attnserve-scripts/setup --runtime --clean
COPY --from=build /build/server/attnserve /build/client/attnserve-cli /usr/local/bin/
# The CLI's default target, for the health check and for `docker exec ... attnserve-cli layers`.
ENV ATTNSERVE_TARGET=127.0.0.1:50051
# A numeric non-root user, so Kubernetes' runAsNonRoot can verify it.
USER 65532:65532
# gRPC (--listen) and Prometheus metrics (--metrics-listen): the server's defaults.
EXPOSE 50051 9464
# The standard gRPC health protocol: SERVING once the layers are loaded and the port is bound,
# NOT_SERVING while draining after SIGTERM.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["attnserve-cli", "--timeout-ms", "4000", "health"]
# SIGTERM starts the graceful drain (--drain-timeout-s); give `docker stop -t` more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["attnserve"]
