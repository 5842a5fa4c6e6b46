"""Reaching nodes across NATs: dial-back checks, port mapping, relays, DHT discovery, join links."""
