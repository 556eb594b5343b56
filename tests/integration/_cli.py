"""The pdserve command line, run as a child process."""

from __future__ import annotations

import sys

PDSERVE = [sys.executable, "-m", "pdserve.cli.main"]
