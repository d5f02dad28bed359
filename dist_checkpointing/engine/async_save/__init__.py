"""Async saves: requests, the callers that run them in the background, the queue."""
