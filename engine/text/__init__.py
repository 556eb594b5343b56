"""Tokenization and incremental detokenization."""
