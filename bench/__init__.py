"""Load-testing tools: request records, serving metrics and plots (no torch, no ray)."""
