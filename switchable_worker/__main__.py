"""``python -m pdserve.switchable_worker``: one standalone switchable worker (starts as a decode worker)."""

from pdserve.switchable_worker.worker import serve
from pdserve.worker.main import run_worker

run_worker(
    "pdserve switchable worker (starts as a decode worker; WorkerService.SetRole switches it)",
    serve,
    prog="python -m pdserve.switchable_worker",
)
