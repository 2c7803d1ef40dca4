#!/usr/bin/env bash
# The fast tests (-m "not slow") again against the OLDEST transformers pyproject.toml declares (the
# newest is what the main install resolves to; the whole suite runs there). The slow end-to-end
# tests are left out here so that CI stays well inside its time limit. A venv that sees this environment's packages, with only transformers
# (and what it pins, e.g. tokenizers) swapped in, so torch and the rest are not downloaded twice.
set -euo pipefail
cd "$(dirname "$0")/.."
oldest=$(python - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
spec = next(d for d in deps if d.startswith("transformers"))
print(re.search(r">=\s*([0-9.]+)", spec).group(1))
PY
)
venv="${TMPDIR:-/tmp}/specx-compat-transformers-$oldest"
[ -x "$venv/bin/python" ] || python -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q "transformers==$oldest.*"
"$venv/bin/python" -c "import transformers; print('compat: transformers', transformers.__version__)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" "$@"
