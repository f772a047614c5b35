# syntax=docker/dockerfile:1
# One image, every command:
#   docker build -t forewarn .
#   docker run forewarn serve --host 0.0.0.0          (the default command)
#   docker run forewarn collect --source dcgm-exporter --url http://HOST:9400/metrics ...
#   docker run forewarn launch --nproc 8 --spares 1 -- python train.py
#   docker run forewarn goodput --json --no-png
# Build arguments:
#   EXTRAS  the extras installed (default server,train,nvidia: the service, the predictor,
#           the migrator with torch and the NVML collector); `--build-arg EXTRAS=node,nvidia`
#           gives a small collector-only image.
#   PIP_EXTRA_INDEX_URL  an extra package index, e.g. PyTorch's CPU wheel index for a CPU-only
#           image (torch from the default index brings the CUDA libraries).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS wheel
WORKDIR /src
# The whole tree: .dockerignore leaves out what the wheel is not built from, so a new
# package is picked up by pyproject.toml alone.
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim
ARG EXTRAS=server,train,nvidia
ARG PIP_EXTRA_INDEX_URL=
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    FOREWARN_DATA_DIR=/data
COPY --from=wheel /wheels /wheels
RUN pip install "$(ls /wheels/forewarn-*.whl)[${EXTRAS}]" && rm -rf /wheels \
 && useradd --create-home --uid 10001 forewarn \
 && mkdir -p /data && chown forewarn /data
WORKDIR /app
# The example job (the default risk model ships inside the wheel; the service loads the
# newest in ./models first, so a volume mounted there brings the operator's own).
COPY examples/ examples/
USER forewarn
EXPOSE 8765
VOLUME ["/data"]
ENTRYPOINT ["forewarn"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8765"]
