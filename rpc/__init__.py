"""gRPC plumbing every pdserve server and client shares: channel options, server start-up with
health checking and reflection, API keys and the cluster secret."""
