"""The memory plan and the cost model: what fits on the device and what a pass costs.

Contract: `membytes` and `memlayers` count bytes per component; `memplan` fits them into a
device budget; `selfplan` plans the self-draft's widths; `draftcost` models seconds per pass and
tokens per second for each draft candidate. Pure arithmetic over headers and card figures: it
reads no weights. The top of `offload`: nothing in `offload` imports it.
"""
