"""Replication between regions: delta-state G-counter gossip with anti-entropy."""
