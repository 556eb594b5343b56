"""KV-cache wire format (codec) and the transfer seam between prefill and decode."""
