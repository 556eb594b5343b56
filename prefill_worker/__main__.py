"""``python -m pdserve.prefill_worker``: one standalone prefill worker."""

from pdserve.engine.host.worker_main import run_worker
from pdserve.prefill_worker.worker import serve

run_worker("pdserve prefill worker", serve)
