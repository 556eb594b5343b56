"""``python -m decode_worker``: one standalone decode worker."""

from decode_worker.worker import serve
from engine.worker_main import run_worker

run_worker("pdserve decode worker", serve)
