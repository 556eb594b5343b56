"""What every worker role shares: the engine's loop thread, per-request token streams, the stats
servicer, the ``python -m pdserve.<role>`` entry point and the engine's command-line flags."""
