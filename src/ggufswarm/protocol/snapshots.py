"""Wire constants of the snapshot cache (docs/protocol.md, "Snapshot cache"), shared by the cache server, the
nodes that store and restore snapshots, and route clients that ask for prefix reuse. No dependencies: a
client imports them without the cache (torch, safetensors)."""

BLOCK_TOKENS = 16  # prefix granularity: snapshots are found and restored in whole blocks of this many tokens
SHA_HEADER = "X-Ggufswarm-Sha256"  # GET /v1/snapshots/{key}: the blob's SHA-256, checked by the node in transit
