"""The node-calibration prior that `specx profile --target --draft` stores.

Contract: `measure_calibration(models, tokens)` decodes PROBE_PROMPTS with `specexec` (budget 64) at
each of TEMPERATURES from the built-in prior and returns {sampling key: acceptance rate per feature},
the profile's `node_calibration`; later runs with the same pair start from it (`pair_prior`).
"""

from __future__ import annotations

from pathlib import Path

from specexec_cli.core import calibrate
from specexec_cli.core.draft import TreeShape
from specexec_cli.core.engine import DecodeState, GenerationConfig, generate, sampling_key
from specexec_cli.core.sampling import SamplingParams

PROBE_PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n",
    "The history of the printing press begins",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
)
TEMPERATURES = (0.0, 0.7)


def measure_calibration(models, tokens: int = 48, progress=None) -> dict:
    out = {}
    steps = len(TEMPERATURES) * len(PROBE_PROMPTS)
    for t_i, temperature in enumerate(TEMPERATURES):
        params = SamplingParams(temperature)
        key = sampling_key(params)
        cal = calibrate.fresh(models.target, models.draft, key)
        for p_i, prompt in enumerate(PROBE_PROMPTS):
            if progress:
                progress(t_i * len(PROBE_PROMPTS) + p_i, steps, f"node calibration, T={temperature:g}")
            cfg = GenerationConfig(
                method="specexec", shape=TreeShape(64, 32), sampling=params, seed=p_i, max_new_tokens=tokens
            )
            for _ in generate(models, DecodeState(), models.tokenizer(prompt)["input_ids"], cfg):
                pass
        out[key] = cal.rates()
    return out


def pair_prior(profile: dict | None, target, draft) -> dict | None:
    """The profile's `node_calibration` when it was measured with this target and draft, else None."""
    models = (profile or {}).get("models") or {}
    stored = (profile or {}).get(calibrate.PROFILE_KEY)
    if not stored or target is None or draft is None:
        return None
    return stored if _same(models.get("target"), target) and _same(models.get("draft"), draft) else None


def _same(a, b) -> bool:
    if a is None or b is None:
        return False
    try:
        return Path(str(a)).expanduser().resolve() == Path(str(b)).expanduser().resolve()
    except OSError:
        return str(a) == str(b)
