# The one image for both services: `gpu-slice device-plugin` and `gpu-slice extender`.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpuslice gpuslice
COPY gpuslice_cli gpuslice_cli
COPY simulator simulator
COPY deviceplugin deviceplugin
COPY extender extender
RUN pip install --no-cache-dir . && rm -rf /src
USER 0
ENTRYPOINT ["gpu-slice"]
