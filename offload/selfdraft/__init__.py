"""The self-draft: the target's own layers at 3 or 2 bits (HQQ) or nf4, as a draft model.

Contract: `build` assembles the draft from the target's Checkpoint and quantized substitutes;
`influence` measures which layers matter most for the draft's agreement. Above `stream`.
"""
