"""``python -m prefill_worker``: one standalone prefill worker."""

from engine.worker_main import run_worker
from prefill_worker.worker import serve

run_worker("pdserve prefill worker", serve)
