"""The worker host: serves one engine over gRPC (loop thread, servicer plumbing, entry point)."""
