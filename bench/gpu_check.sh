#!/usr/bin/env bash
# bench/gpu.py on a CUDA host that has no llama-cpp-python with CUDA and no network: builds llama.cpp's
# libraries with CUDA from a tarball of the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, lays them
# into a copy of the llama_cpp package (the pure-Python part of the pinned release), installs the
# wheels graftmem needs, then runs `python -m bench.gpu "$@"`.
#
# usage: GPU_DIR=.gpu OUT=/tmp/out bash bench/gpu_check.sh [bench.gpu arguments...]
# --exclude-libs,ALL: with CUDA 13.0 and g++ 13.3 (this workplace's H200 image) libggml-cuda.so carried a
# static libstdc++ and exported its symbols; libllama's std::ostream calls bound to that copy and every
# model load segfaulted in llama_model::print_info. Not exporting symbols of static archives fixes it
# (measured: bench/results/gpu_h200.json "build"); it changes no kernel.
# GPU_DIR holds: llama-src.tgz, whl/*.whl (cp312), py/llama_cpp/ (no lib/) and py/<pure-Python packages>, cache/llama-cpp-python-0.3.36/
# (the vendored vocab, template and gguf-py, as scripts/tiny_models.py extracts them). The build is kept in
# $GPU_DIR/build and reused by a later run on the same machine. With network access, a plain
# `CMAKE_ARGS="-DGGML_CUDA=on" pip install llama-cpp-python==0.3.36` and `python -m bench.gpu` do the same.
set -euo pipefail
G=${GPU_DIR:-.gpu}
OUT=${OUT:-/tmp/gpu-out}
ARCH=${CUDA_ARCH:-90}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/whl/*.whl
B=$G/build
if [ ! -f "$B/done" ]; then
  rm -rf "$B" && mkdir -p "$B/src" && tar xzf "$G/llama-src.tgz" -C "$B/src"
  t0=$(date +%s)
  cmake -S "$B/src" -B "$B/b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_SHARED_LINKER_FLAGS="-Wl,--exclude-libs,ALL" > "$OUT/cmake.log" 2>&1 \
    || { tail -40 "$OUT/cmake.log"; exit 1; }
  cmake --build "$B/b" -j "$(nproc)" --target llama > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
  echo "graftmem: llama.cpp with CUDA (sm_$ARCH) built in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.log"
  touch "$B/done"
fi
# the pure-Python packages: llama_cpp, and what the server phase needs that the image lacks (h11, anyio, httpx, ...)
for d in "$G"/py/*/; do rm -rf "/tmp/site/$(basename "$d")" && cp -r "$d" /tmp/site/; done
mkdir -p /tmp/site/llama_cpp/lib
find "$B/b" -name "*.so*" -exec cp -a {} /tmp/site/llama_cpp/lib/ \;
export GRAFTMEM_MODEL_CACHE=${GRAFTMEM_MODEL_CACHE:-/tmp/graftmem-models}
mkdir -p "$GRAFTMEM_MODEL_CACHE" && cp -r "$G"/cache/. "$GRAFTMEM_MODEL_CACHE"/
export PYTHONPATH=/tmp/site:$PWD LD_LIBRARY_PATH=/tmp/site/llama_cpp/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ls /tmp/site/llama_cpp/lib
python3 -m bench.gpu "$@"
