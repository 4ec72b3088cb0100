"""The shared vocabulary, under the core: workflow ids and message names, version
ranges, the shard layout and the metric objects. It imports nothing of agentroster's
above it, so every layer (the core included) can use it.
"""
