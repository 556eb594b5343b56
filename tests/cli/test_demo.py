"""The demo's packaged prompts load from the installed package (the README's first command runs
``pdserve demo``, which reads them before any worker starts)."""

from __future__ import annotations

import subprocess
import sys

from pdserve.cli.demo import demo_prompts


def test_demo_prompts_are_packaged_with_the_cli() -> None:
    prompts = demo_prompts()
    assert len(prompts) == 6 and all(p.strip() for p in prompts)
    assert sum(any("\u4e00" <= ch <= "\u9fff" for ch in p) for p in prompts) == 3  # three Chinese prompts


def test_demo_prompts_load_outside_the_checkout(tmp_path) -> None:
    # From another working directory the checkout's folders are not importable as such: the file must
    # come from the installed package.
    code = "from pdserve.cli.demo import demo_prompts; print(len(demo_prompts()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "6", out.stderr
