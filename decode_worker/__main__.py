"""``python -m pdserve.decode_worker``: one standalone decode worker."""

from pdserve.decode_worker.worker import serve
from pdserve.worker.main import run_worker

run_worker("pdserve decode worker", serve, prog="python -m pdserve.decode_worker")
