"""The decoding core: the engine that yields step events, tree, draft, verify, pure sampling, KV caches, methods."""
