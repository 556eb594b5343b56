"""``python -m pdserve.colocated_worker``: one standalone colocated worker (prefill and decode)."""

from pdserve.colocated_worker.worker import serve
from pdserve.worker.main import run_worker

run_worker("pdserve colocated worker", serve, prog="python -m pdserve.colocated_worker")
