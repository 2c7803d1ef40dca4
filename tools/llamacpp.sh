#!/usr/bin/env bash
# llama.cpp's own GGUF tools, the oracle for specx's GGUF reader (tests/test_gguf*.py):
# convert_hf_to_gguf.py and the llama-quantize binary, both from the llama-cpp-python source
# distribution (PyPI), built on CPU into a cache folder the tests look in:
#   $SPECX_TEST_CACHE/llamacpp (default ~/.cache/specx-test/llamacpp)
#     src/            the unpacked llama.cpp tree (convert_hf_to_gguf.py, gguf-py)
#     bin/llama-quantize
#     OK              written last: the tests use the folder only when it exists
# Idempotent: a finished build returns at once. Version: LLAMACPP_PY_VERSION (default below).
# Jobs: LLAMACPP_JOBS (default 2). Exit status non-zero when the build fails (CI ignores it:
# the tests that need it then skip).
set -euo pipefail
version="${LLAMACPP_PY_VERSION:-0.3.36}"
cache="${SPECX_TEST_CACHE:-$HOME/.cache/specx-test}/llamacpp"
jobs="${LLAMACPP_JOBS:-2}"
if [ -f "$cache/OK" ] && [ "$(cat "$cache/OK")" = "$version" ]; then
    echo "llamacpp: cached in $cache"
    exit 0
fi
rm -rf "$cache"
mkdir -p "$cache/dl"
start=$(date +%s)
pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$cache/dl"
tar -xzf "$cache"/dl/llama_cpp_python-*.tar.gz -C "$cache/dl"
mv "$cache"/dl/llama_cpp_python-*/vendor/llama.cpp "$cache/src"
rm -rf "$cache/dl"
# convert_hf_to_gguf.py's own requirement for Llama-family vocabularies
pip install -q "sentencepiece>=0.2,<0.3"
# The one local patch (never committed anywhere): a tokenizer whose pre-tokenizer hash llama.cpp
# does not list (the tests' small models) converts with the pre-tokenizer named in
# $SPECX_GGUF_PRE (e.g. gpt-2) instead of stopping; unset, the converter behaves as shipped.
python - "$cache/src/conversion/base.py" <<'PY'
import sys
path = sys.argv[1]
src = open(path).read()
anchor = "        if res is None:\n"
assert src.count(anchor) == 1, "llama.cpp changed get_vocab_base_pre; update tools/llamacpp.sh"
patch = "        if res is None and os.environ.get('SPECX_GGUF_PRE'): res = os.environ['SPECX_GGUF_PRE']\n"
open(path, "w").write(src.replace(anchor, patch + anchor))
PY
cmake -S "$cache/src" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >"$cache/cmake.log" 2>&1
cmake --build "$cache/build" --target llama-quantize -j"$jobs" >"$cache/build.log" 2>&1
mkdir -p "$cache/bin"
cp "$cache/build/bin/llama-quantize" "$cache/bin/"
rm -rf "$cache/build"
echo "$version" >"$cache/OK"
echo "llamacpp: built llama-quantize in $(( $(date +%s) - start )) s into $cache"
