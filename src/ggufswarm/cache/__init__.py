"""Prefix KV snapshot cache: the snapshot format, its content-addressed store, and the ``ggufswarm cache`` server."""
