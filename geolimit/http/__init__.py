"""HTTP integrations: shared headers, keys and the request guard."""
