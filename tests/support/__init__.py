"""Shared test support: the multi-rank harness, layouts, golden checkpoint helpers."""
