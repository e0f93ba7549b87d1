"""Finding, downloading (from a local file:// zip) and verifying the raw MovieLens files; `data stats`."""

import hashlib
import zipfile

import pytest
from gemrec.cli import main
from gemrec.components.data_service import movielens
from gemrec.components.data_service.errors import DataError


@pytest.fixture
def local_zip(tmp_path, movielens_raw):
    """The official archive layout (ml-latest-small/...) built from the raw files."""
    path = tmp_path / "ml-latest-small.zip"
    with zipfile.ZipFile(path, "w") as archive:
        for f in sorted(movielens_raw.iterdir()):
            archive.write(f, f"ml-latest-small/{f.name}")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_download_checks_sha256_and_unpacks(tmp_path, local_zip):
    path, digest = local_zip
    root = tmp_path / "cache"
    with pytest.raises(DataError, match="does not match the pinned"):
        movielens.download(root, url=path.as_uri(), sha256="0" * 64)
    assert not (root / movielens.NAME).exists() and list(root.iterdir()) == []
    target = movielens.download(root, url=path.as_uri(), sha256=digest)
    assert target == root / movielens.NAME and (target / "ratings.csv").is_file()
    assert movielens.verify_checksums(target, ["ratings.csv"])["ratings.csv"].startswith("sha256:80da8b33")


def test_raw_dir_resolution_prefers_gemrec_data_dir(tmp_path, monkeypatch, movielens_raw):
    monkeypatch.setenv("GEMREC_DATA_DIR", str(tmp_path))
    assert movielens.candidate_dirs()[0] == tmp_path / movielens.NAME
    (tmp_path / movielens.NAME).mkdir()
    (tmp_path / movielens.NAME / "ratings.csv").write_text("userId,movieId,rating,timestamp\n")
    assert movielens.resolve_raw_dir() == tmp_path / movielens.NAME
    assert movielens.resolve_raw_dir(movielens_raw) == movielens_raw


def test_stats_prints_counts_and_writes_plot(movielens_dataset, tmp_path, capsys):
    plot = tmp_path / "stats.png"
    assert main(["data", "stats", str(movielens_dataset), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "events 100,836  users 610  items 9,742" in out and "like 0.4885" in out and "valid" in out
    assert "history length histogram" in out and "1024-2047" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
