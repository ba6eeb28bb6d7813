#!/usr/bin/env bash
# Builds llama.cpp's llama-server (and libllama, which llama-cpp-python can load) from the
# llama.cpp tree inside the llama-cpp-python sdist, for the side-by-side benchmarks
# (benchmarks/server_concurrency.py, benchmarks/cpu_vs_llama_cpp.py). Never committed.
#
#   scripts/build_llama_cpp.sh native|avx2|avx512 OUT_DIR [VERSION]
#
# native: -march=native (GGML_NATIVE=ON). avx2: the x86-64-v3 build laptops and AMD Zen 2/3 get.
# avx512: AVX-512 with VNNI and BF16 but GGML_NATIVE=OFF, for Intel CPUs with AMX, where the
# native build's AMX path crashes at `ldtilecfg` on the VMs here.
# About 8 minutes on 2 cores. Then: OUT_DIR/bin/llama-server, and OUT_DIR/bin/libllama.so for
# LLAMA_CPP_LIB_PATH=OUT_DIR/bin with llama-cpp-python installed without its own build:
#   CMAKE_ARGS=-DLLAMA_BUILD=OFF pip install --no-deps SDIST && pip install diskcache
set -euo pipefail
variant=${1:?native, avx2 or avx512}
out=${2:?output directory}
version=${3:-0.3.36}
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
pip download -q --no-deps --no-binary :all: -d "$src" "llama-cpp-python==$version"
tar xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
case "$variant" in
  native) flags=(-DGGML_NATIVE=ON) ;;
  avx2) flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
               -DGGML_AVX512=OFF) ;;
  avx512) flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                 -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON) ;;
  *) echo "unknown variant $variant: native, avx2 or avx512" >&2; exit 2 ;;
esac
cmake -S "$src"/llama_cpp_python-*/vendor/llama.cpp -B "$out" -DCMAKE_BUILD_TYPE=Release "${flags[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$out" --target llama-server -j"$(nproc)"
echo "built $out/bin/llama-server ($variant)"
