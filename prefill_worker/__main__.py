"""``python -m pdserve.prefill_worker``: one standalone prefill worker."""

from pdserve.worker.main import run_worker
from pdserve.prefill_worker.worker import serve

run_worker("pdserve prefill worker", serve)
