# rollsafe: the checkpoint worker, and the Ray node image for the run's cluster (one image, so
# Python, Ray and rollsafe are the same version on both sides of a Ray Client connection).
#
#   docker build -t rollsafe:local .
#   docker run --rm rollsafe:local worker --help
#
# Not built in this repository's CI (no Docker there): the compose file and the Kubernetes
# manifests that use it are checked against their schemas only (docs/deploy.md).
FROM python:3.11-slim

# torch is pinned and installed first from a CPU-only index, as the Makefile does with the CPU
# wheel on disk: the project's range (torch>=2.11,<2.15) is then already satisfied, and pip
# does not pull a multi-GB CUDA build. For GPU nodes, build with a CUDA index instead.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0

# tini: PID 1 that forwards SIGTERM to the worker (which drains on it) and reaps children.
# wget: KubeRay's default probes of Ray head and worker pods run it inside the container.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini wget \
    && rm -rf /var/lib/apt/lists/*

# uid 1000: Ray's own images use it, and the manifests' fsGroup makes the shared snapshot
# volume writable for it.
RUN useradd --create-home --uid 1000 --shell /bin/bash rollsafe \
    && mkdir -p /shared/rollsafe \
    && chown rollsafe:rollsafe /shared/rollsafe

RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/rollsafe
COPY pyproject.toml README.md ./
COPY rollsafe ./rollsafe
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
COPY reference ./reference
RUN pip install . && rm -rf build *.egg-info
# The first-run check of docs/deploy.md, run as a Ray driver on a Ray node.
COPY infra/smoke/checkpoint_smoke.py ./smoke/checkpoint_smoke.py

USER rollsafe
EXPOSE 8080
ENTRYPOINT ["tini", "--", "rollsafe"]
# The run id comes from ROLLSAFE_RUN_ID; Temporal from TEMPORAL_*; Ray from RAY_ADDRESS.
CMD ["worker", "--health-port", "8080", "--drain-timeout", "30"]
