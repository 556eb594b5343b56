"""Command-line flags about Ray placement, shared by ``pdserve serve`` and ``pdserve soak``."""

from __future__ import annotations

import argparse


def add_role_resource_args(p: argparse.ArgumentParser) -> None:
    """--prefill-resource/--decode-resource: pin each split role to the Ray nodes offering a custom resource."""
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}-resource",
            default=None,
            metavar="NAME",
            help=f"split: run {role} workers only on Ray nodes that offer this custom resource, one "
            f"unit per worker (`ray start --resources '{{\"NAME\": N}}'`)",
        )
