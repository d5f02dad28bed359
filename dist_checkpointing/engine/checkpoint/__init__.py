"""The checkpoint directory: its handle, the commit protocol, integrity manifests."""
