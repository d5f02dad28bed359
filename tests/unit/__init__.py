"""Single-process tests: pure functions, value objects, the registry, the house rules."""
