"""``python -m pdserve.prefill_worker``: one standalone prefill worker."""

from pdserve.prefill_worker.worker import serve
from pdserve.worker.main import run_worker

run_worker("pdserve prefill worker", serve, prog="python -m pdserve.prefill_worker")
