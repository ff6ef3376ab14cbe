# The one image for both services: `gpu-slice device-plugin` (the DaemonSet) and `gpu-slice extender`
# (the scheduler pod's sidecar). The entrypoint is the `gpu-slice` command; the manifests pass the
# subcommand as the first argument.
#
#   make image                      # docker build -t gpu-slice:0.1.0 .
#
# The base is pinned to an exact Python patch release on Debian bookworm; pin its digest as well
# (`docker buildx imagetools inspect python:3.11.13-slim-bookworm`) in your registry's copy.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY gpuslice gpuslice
COPY gpuslice_cli gpuslice_cli
COPY simulator simulator
COPY deviceplugin deviceplugin
COPY extender extender
RUN python -m venv /opt/gpu-slice \
 && /opt/gpu-slice/bin/pip install . \
 && /opt/gpu-slice/bin/gpu-slice --version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpu-slice" \
      org.opencontainers.image.description="Fractional GPUs for Kubernetes: device plugin and scheduler extender" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/gpu-slice /opt/gpu-slice
ENV PATH=/opt/gpu-slice/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib
# Non-root by default (the extender and the scheduler pod run as 65532). The device plugin's
# DaemonSet runs it as root to create sockets in kubelet's directories.
USER 65532:65532
ENTRYPOINT ["gpu-slice"]
CMD ["--help"]
