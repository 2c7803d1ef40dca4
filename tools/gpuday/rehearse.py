"""`gpu_day.py rehearse`: the box's install and `run --smoke`, on this CPU machine, before the day.

Contract:
- A venv without system site-packages (default: $TMPDIR/specx-gpuday-image) holding the image's
  versions where they install here (transformers 5.17.0, as on the image) and the image's other
  packages the run touches (IMAGE_HERE), torch as the local CPU build 2.13.0 (the image's 2.11 CUDA
  build would download GBs), and none of the packages the image lacks (what a newer release of an
  image package pulls in here, e.g. typer's pydantic, is uninstalled again). Built once, reused.
- A pack for THIS machine's Python (pack.build, into <venv>/whl), installed exactly as on the box:
  `python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target
  <venv>/site <venv>/whl/*.whl`, then `PYTHONPATH=<venv>/site:. python tools/gpu_day.py run --smoke
  --out <out>` from the repo root (default out: <venv>/out, emptied first).
- Exit: the run's exit code (0: every phase passed), 1 when the venv or the install fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tools.gpuday import pack
from tools.gpuday.image import IMAGE_PACKAGES, norm

IMAGE_HERE = [
    "torch==2.13.0",
    "transformers==5.17.0",
    "accelerate==1.15.0",
    "safetensors==0.8.0",
    "tokenizers",
    "numpy",
    "rich",
    "typer",
    "psutil",
    "httpx",
    "jinja2",
    "pytest",
    "scipy",
    "packaging",
    "einops",
    "tqdm",
    "pyyaml",
    "requests",
    "anyio",
    "h11",
    "click",
    "annotated-doc",
    "typing-extensions",
    "huggingface-hub",
]


def step(cmd: list[str], **kw) -> None:
    print(
        "rehearse: " + " ".join(str(c) for c in cmd[:8]) + (" ..." if len(cmd) > 8 else ""), file=sys.stderr, flush=True
    )
    proc = subprocess.run(cmd, **kw)
    if proc.returncode:
        raise SystemExit(f"gpu_day rehearse: {' '.join(str(c) for c in cmd[:6])} ... exited {proc.returncode}")


def image_venv(venv: Path) -> Path:
    """The image-shaped venv's python (built on first use; a finished build leaves `.done`)."""
    py = venv / "bin" / "python"
    if (venv / ".done").exists():
        return py
    shutil.rmtree(venv, ignore_errors=True)
    step([sys.executable, "-m", "venv", str(venv)])
    step([str(py), "-m", "pip", "install", "-q", *IMAGE_HERE])
    listed = subprocess.run(
        [str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout.split()
    extra = [n.split("==")[0] for n in listed if norm(n.split("==")[0]) not in IMAGE_PACKAGES]
    if extra:  # pulled in here by a newer release of an image package (typer -> pydantic): not on the image
        step([str(py), "-m", "pip", "uninstall", "-q", "-y", *extra])
    (venv / ".done").write_text("")
    return py


def main(root: Path, venv: Path | None, out: Path | None) -> int:
    venv = venv or Path(os.environ.get("TMPDIR", "/tmp")) / "specx-gpuday-image"
    out = out or venv / "out"
    py = image_venv(venv)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheels = pack.build(root, venv / "whl", here)
    site = venv / "site"
    shutil.rmtree(site, ignore_errors=True)
    step(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(site),
            *map(str, wheels),
        ]
    )
    shutil.rmtree(out, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = f"{site}{os.pathsep}."
    print(f"rehearse: PYTHONPATH={env['PYTHONPATH']} {py} tools/gpu_day.py run --smoke --out {out}", file=sys.stderr)
    code = subprocess.run(
        [str(py), "tools/gpu_day.py", "run", "--smoke", "--out", str(out)], cwd=root, env=env
    ).returncode
    print(f"rehearse: run --smoke exited {code}; its JSON is in {out}")
    return code
