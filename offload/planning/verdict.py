"""Whether a memory plan fits, and if not, why in one line that names the fix.

Contract: `verdict(plan, req)` -> (fits, reason) of a finished MemoryPlan: the one combination no plan can
serve (4-bit substitutes of a 4-bit target), the device total against its capacity (fixes fitted to the
request), then the host total against the host capacity. An empty reason when it fits.
"""

from __future__ import annotations

from offload.sizes import format_bytes


def verdict(plan, req) -> tuple[bool, str]:
    if req.self_draft and req.dtype == "nf4" and req.draft_bits == 4:
        return False, (
            "--draft self: the target is already 4-bit, so 4-bit substitutes would be the target "
            "itself; fix: --draft-bits 3 or 2, --dtype bf16 for the target, or a small --draft DIR"
        )
    where = "GPU memory" if req.device == "cuda" else "RAM for the model"
    if plan.device_total > plan.device_capacity:
        fixes = ["a smaller --ctx or --budget"]
        if req.self_draft:
            fixes.append(
                f"a small --draft DIR (the {req.draft_bits}-bit substitutes alone need "
                f"{format_bytes(plan.device_bytes.get('draft', 0))})"
            )
        elif req.dtype != "nf4":
            fixes.append("--dtype nf4")
        if req.draft_dtype is not None and not req.self_draft:
            fixes.append("a smaller draft")
        if plan.embeddings == "device" and req.device == "cuda":
            fixes.append("--embeddings host")
        if req.offload == "none":
            fixes.append("--offload auto")
        fix = f"{', '.join(fixes[:-1])} or {fixes[-1]}" if len(fixes) > 1 else fixes[0]
        return False, (
            f"the memory plan needs {format_bytes(plan.device_total)} of {where} but has "
            f"{format_bytes(plan.device_capacity)}; fix: {fix}"
        )
    if plan.host_total > plan.host_capacity:
        return False, (
            f"the memory plan needs {format_bytes(plan.host_total)} of host RAM but "
            f"{format_bytes(plan.host_capacity)} is available; fix: a smaller --max-ram "
            "(the rest streams from disk) or --offload disk"
        )
    return True, ""
