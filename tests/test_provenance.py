"""`gemrec.provenance.git_commit`: the environment's commit (snapshot copies without .git), else git's HEAD."""

import re

from gemrec.provenance import git_commit


def test_git_commit_prefers_the_environment(monkeypatch):
    monkeypatch.setenv("GEMREC_GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    assert git_commit() == "0123456789abcdef0123456789abcdef01234567"
    assert git_commit(short=True) == "0123456"


def test_git_commit_reads_the_checkout(monkeypatch):
    monkeypatch.delenv("GEMREC_GIT_COMMIT", raising=False)
    full = git_commit()
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", full)
    assert git_commit(short=True) == full[:7]
