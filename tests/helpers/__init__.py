"""Shared test helpers: tiny models, attention cases, the server harness."""
