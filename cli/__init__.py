"""The ``pdserve`` command, one module per subcommand: serve, generate, demo, bench, compare,
throughput (``soak`` lives in ``pdserve.soak``)."""
