"""The llama.cpp shard backend: derived shard GGUFs and a llama.cpp context per shard (see backend.py)."""
