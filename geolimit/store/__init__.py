"""Storage back-ends and helpers."""
