"""Test suite of dist_checkpointing (a package, so that rank functions pickle by module name)."""
