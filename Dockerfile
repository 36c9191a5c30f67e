# syntax=docker/dockerfile:1
# epd container image: the daemon (epd) and its CLI (epctl), nothing else.
#
#   docker build -t epd:0.1.0 .
#   docker run -d --name epd --gpus all --ipc=host -v /run/epd:/run/epd \
#     -v /run/nvidia-mps:/run/nvidia-mps -p 50051:50051 epd:0.1.0
#   docker exec epd epctl status
#
# Base choice: Debian 12 for both stages, with the CUDA 13.0 toolkit copied out of the
# official nvidia/cuda devel image (rather than building on nvidia/cuda:*-ubuntu24.04).
# The build stage is then the same system CI tests on: the same distribution, g++ 12 and
# the same gRPC 1.51 / protobuf 3.21 / abseil 20220623 / spdlog 1.10 packages, installed
# by the same deploy/install-deps.sh. The toolkit is relocatable and needs no package of
# its own; x86_64 only. The runtime stage is debian:12-slim plus exactly the Debian
# packages that hold the libraries epd and epctl load (deploy/runtime-packages.sh reads
# them off the built binaries), libcudart, and no compiler, headers or sources. The
# NVIDIA container toolkit injects the driver (libcuda.so.1) at run time.

ARG CUDA_DEVEL_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
ARG CUDA_DIR=/usr/local/cuda-13.0

# ---- the CUDA toolkit, taken from NVIDIA's image ----
FROM ${CUDA_DEVEL_IMAGE} AS cuda

# ---- build stage ----
FROM debian:12 AS build
ARG CUDA_DIR
COPY --from=cuda ${CUDA_DIR} ${CUDA_DIR}
RUN ln -s "${CUDA_DIR}" /usr/local/cuda
WORKDIR /src
# Dependencies first, as their own layer: rebuilt only when the package list changes.
COPY deploy/install-deps.sh deploy/install-deps.sh
RUN bash deploy/install-deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
# CUDA and RDMA ON (not AUTO): an image without the CUDA backend would be a broken image,
# so a missing toolkit fails the build here. sm_80 and sm_90 SASS + compute_80 PTX (CMakeLists.txt).
RUN cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DEPD_WITH_CUDA=ON -DEPD_WITH_RDMA=ON -DEPD_BUILD_TESTS=OFF \
      -DCMAKE_CUDA_COMPILER="${CUDA_DIR}/bin/nvcc" \
 && cmake --build /build --target epd epctl \
 && install -D -m 0755 /build/daemon/epd /out/usr/local/bin/epd \
 && install -D -m 0755 /build/client/epctl /out/usr/local/bin/epctl \
 && strip --strip-unneeded /out/usr/local/bin/epd /out/usr/local/bin/epctl
# libcudart is shipped beside the binaries (it belongs to no Debian package); every other
# library they load must come from a Debian package (--strict), listed for the runtime.
RUN mkdir -p /out/usr/local/lib/epd \
 && cp -a "${CUDA_DIR}"/targets/x86_64-linux/lib/libcudart.so.13* /out/usr/local/lib/epd/ \
 && LD_LIBRARY_PATH="${CUDA_DIR}/targets/x86_64-linux/lib" \
    bash deploy/runtime-packages.sh --strict --ignore 'libcudart.so.*' \
      /out/usr/local/bin/epd /out/usr/local/bin/epctl >/out/runtime-packages.txt \
 && echo "runtime packages:" && cat /out/runtime-packages.txt

# ---- runtime stage ----
FROM debian:12-slim AS runtime
COPY --from=build /out/runtime-packages.txt /tmp/runtime-packages.txt
RUN apt-get update \
 && xargs -r -a /tmp/runtime-packages.txt env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt
COPY --from=build /out/usr/local/ /usr/local/
RUN echo /usr/local/lib/epd >/etc/ld.so.conf.d/epd.conf && ldconfig \
 && mkdir -p /run/epd /var/cache/epd
COPY deploy/examples/container.textproto /etc/epd/epd.textproto

# The NVIDIA container toolkit reads these (this is not an nvidia/cuda image, which would
# set them): every GPU, compute + nvidia-smi.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    CUDA_MODULE_LOADING=EAGER \
    CUDA_CACHE_PATH=/var/cache/epd/nv \
    CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps
EXPOSE 50051
# grpc.health.v1 over the unix socket; exits non-zero unless epd is SERVING.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["/usr/local/bin/epctl", "--socket=/run/epd/epd.sock", "health"]
# SIGTERM drains and exits 0 within 5 s (docker stop's default 10 s grace is enough).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/epd"]
CMD ["--config=/etc/epd/epd.textproto"]
