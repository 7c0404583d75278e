# One image for every Trainyard service (docker-compose.yml picks the command).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1
WORKDIR /app

# A C compiler for deterministic mode's kernels (kernels/csrc/invariant.c, built per CPU on first use); jemalloc for
# the processes that hold models (docker-compose.yml's training environment); bubblewrap for the evaluator sandbox.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libjemalloc2 bubblewrap \
    && rm -rf /var/lib/apt/lists/*

# CPU build of torch first so nothing else pulls a CUDA build; GPU images swap this index URL.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX_URL}

COPY requirements.lock .
RUN pip install -r requirements.lock

COPY . .
RUN pip install --no-deps -e .

VOLUME ["/data"]
EXPOSE 50051 50052 50053 50054 8501
CMD ["python", "-m", "services.scheduler"]
