"""Servers: the per-region agent (gossip endpoint and HTTP decision API)."""
