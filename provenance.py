"""Which commit this code is, for benchmark reports and MLflow tags: `$GEMREC_GIT_COMMIT` (set in the container images
and by the GPU session scripts for their snapshot copies, which have no .git), else the checkout's HEAD, else
"unknown". Like `gemrec.config`, this module imports nothing from gemrec, so every layer records the same value."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent


def git_commit(short: bool = False) -> str:
    """The commit's hash (`short`: its first 7 hex digits, as `git rev-parse --short` shows it)."""
    commit = os.environ.get("GEMREC_GIT_COMMIT")
    if not commit:
        try:
            out = subprocess.run(
                ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            )
            commit = out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "unknown"
    return commit[:7] if short else commit
