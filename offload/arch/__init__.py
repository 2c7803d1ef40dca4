"""Model support: what each architecture family needs to run layer by layer.

Contract: `families` checks a config's `model_type` and builds one decoder layer's skeleton;
`attention` is the GQA-folding SDPA registered with transformers; `hfcompat` bridges the
transformers versions we test. Imports nothing else from `offload` but `errors`.
"""
