#!/usr/bin/env bash
# llama.cpp's own GGUF tools, the oracle for specx's GGUF reader (tests/test_gguf*.py):
# convert_hf_to_gguf.py and the llama-quantize binary, both from the llama-cpp-python source
# distribution (PyPI), built on CPU into a cache folder the tests look in; the same build also
# gives the peer binaries bench/peers_real.py measures specx against:
#   $SPECX_TEST_CACHE/llamacpp (default ~/.cache/specx-test/llamacpp)
#     src/            the unpacked llama.cpp tree (convert_hf_to_gguf.py, gguf-py)
#     bin/llama-quantize    GGUF requantizer (the tests' oracle)
#     bin/llama-bench       plain-decoding throughput (tg/pp)
#     bin/llama-completion  one-shot generation (the classic llama-cli; the new llama-cli needs the server)
#     bin/llama-simple      minimal greedy generation
#     bin/llama-lookup      prompt-lookup (n-gram) speculative decoding, no second model
#     OK              written last: the tests use the folder only when it exists; it holds the
#                     version and the build flavour, so a cache from an older flavour rebuilds
# Idempotent: a finished build returns at once. Version: LLAMACPP_PY_VERSION (default below).
# Jobs: LLAMACPP_JOBS (default 2). CPU tuning: LLAMACPP_NATIVE (default 1: the host's instruction
# set, as llama.cpp builds by default; 0: a portable AVX2 build). Exit status non-zero when the
# build fails (CI ignores it: the tests that need it then skip).
set -euo pipefail
version="${LLAMACPP_PY_VERSION:-0.3.36}"
cache="${SPECX_TEST_CACHE:-$HOME/.cache/specx-test}/llamacpp"
jobs="${LLAMACPP_JOBS:-2}"
native="${LLAMACPP_NATIVE:-1}"
if [ "$native" = 1 ]; then native_flag=ON; else native_flag=OFF; fi
targets="llama-quantize llama-bench llama-completion llama-simple llama-lookup"
marker="$version tools-2 native=$native_flag"
if [ -f "$cache/OK" ] && [ "$(cat "$cache/OK")" = "$marker" ]; then
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
# Tools and examples on (llama-bench/completion are tools, simple/lookup examples); the server and
# the new llama-cli (built on the server) off; static, so bin/ needs no shared libraries beside it.
cmake -S "$cache/src" -B "$cache/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE="$native_flag" \
    -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DBUILD_SHARED_LIBS=OFF >"$cache/cmake.log" 2>&1
# shellcheck disable=SC2086  # one target per word
cmake --build "$cache/build" --target $targets -j"$jobs" >"$cache/build.log" 2>&1
mkdir -p "$cache/bin"
for t in $targets; do cp "$cache/build/bin/$t" "$cache/bin/"; done
rm -rf "$cache/build"
echo "$marker" >"$cache/OK"
echo "llamacpp: built $targets in $(( $(date +%s) - start )) s into $cache"
