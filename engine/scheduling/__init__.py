"""Continuous-batching scheduling: sequences, the paged-KV block manager and the scheduler."""
