"""Compatibility: Megatron-Core golden checkpoints, plain DCP interop, the torch compat layer."""
