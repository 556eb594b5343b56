"""gRPC plumbing every pdserve server and client shares: channel options, server start-up with
health checking, reflection and the refusal of request bytes that do not parse, API keys and the
cluster secret."""
