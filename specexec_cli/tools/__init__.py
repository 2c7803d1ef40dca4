"""Tools over the session layer: `specx profile` (profiler), `specx bench` and `specx quantize`."""
