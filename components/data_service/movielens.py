"""MovieLens ml-latest-small: find or download the raw files, verify them, prepare the dataset.

Labels: like = rating >= 4.0, love = rating >= 4.5. Actions of history tokens: rating / 5, like, love.
Item features: genres (multi-valued), release year (5-year buckets, from the title), tags (multi-valued,
only tags applied before the train/eval cutoff, so eval-time tags do not leak into features).
"""

from __future__ import annotations

import os
import shutil
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from .builder import EventLog, SideTable, SplitConfig, build_dataset, file_sha256
from .encoding import categorical_from_strings
from .errors import DataError
from .readers import fail_rows, parse_numeric, parse_timestamps, read_table, require_non_null

NAME = "movielens-latest-small"
URL = "https://files.grouplens.org/datasets/movielens/ml-latest-small.zip"
ZIP_SHA256 = "696d65a3dfceac7c45750ad32df2c259311949efec81f0f144fdfb91ebc9e436"
REPO_ROOT = Path(__file__).resolve().parents[2]
NO_GENRE = "(no genres listed)"


def candidate_dirs() -> list[Path]:
    """Where an already downloaded copy is looked for, in order."""
    candidates = []
    if os.environ.get("GEMREC_DATA_DIR"):
        candidates.append(Path(os.environ["GEMREC_DATA_DIR"]) / NAME)
    candidates.append(REPO_ROOT.parent / "shared" / "data" / NAME)
    candidates.append(Path.cwd().parent / "shared" / "data" / NAME)
    return candidates


def download_root() -> Path:
    return Path(os.environ.get("GEMREC_DATA_DIR") or Path.home() / ".cache" / "gemrec" / "data")


def resolve_raw_dir(raw: Path | None = None) -> Path:
    """`raw` if given, else the first candidate folder with ratings.csv, else a fresh download."""
    if raw is not None:
        raw = Path(raw)
        if not (raw / "ratings.csv").is_file():
            raise DataError(f"{raw}: no ratings.csv (expected the ml-latest-small folder)")
        return raw
    for candidate in candidate_dirs():
        if (candidate / "ratings.csv").is_file():
            return candidate
    return download(download_root())


def download(root: Path, url: str = URL, sha256: str = ZIP_SHA256) -> Path:
    """Download and unpack the official zip into root/movielens-latest-small, checking its sha256."""
    target = root / NAME
    if (target / "ratings.csv").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    part = root / f".{NAME}.zip.part-{os.getpid()}"
    unpack = root / f".{NAME}.unpack-{os.getpid()}"
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(part, "wb") as f:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"download {NAME}") as bar:
                for chunk in iter(lambda: response.read(1 << 16), b""):
                    f.write(chunk)
                    bar.update(len(chunk))
        got = file_sha256(part)
        if got != sha256:
            raise DataError(f"{url}: sha256 {got} does not match the pinned {sha256}")
        with zipfile.ZipFile(part) as archive:
            archive.extractall(unpack)
        inner = next(p for p in unpack.iterdir() if p.is_dir())
        inner.rename(target)
    except OSError as err:
        raise DataError(f"cannot download {url} ({err}); pass --raw DIR with the unpacked ml-latest-small") from err
    finally:
        part.unlink(missing_ok=True)
        shutil.rmtree(unpack, ignore_errors=True)
    return target


def verify_checksums(raw: Path, files: list[str]) -> dict[str, str]:
    """sha256 of the input files; checked against raw/SHA256SUMS when that file is present."""
    sums = {name: file_sha256(raw / name) for name in files if (raw / name).is_file()}
    listing = raw / "SHA256SUMS"
    if listing.is_file():
        for line_no, line in enumerate(listing.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise DataError(f"{listing}: line {line_no}: expected '<sha256>  <file>'")
            expected, name = parts[0].lower(), parts[1].lstrip("*")
            path = raw / name
            if not path.is_file():
                raise DataError(f"{path}: listed in {listing.name} but missing")
            actual = sums.get(name) or file_sha256(path)
            if actual != expected:
                raise DataError(f"{path}: sha256 {actual} does not match {listing.name} ({expected})")
    return {name: "sha256:" + digest for name, digest in sums.items()}


def year_bucket(titles: pd.Series) -> pd.Series:
    """'1995-1999'-style 5-year buckets of the release year in the title, '<1930', or 'unknown'."""
    year = pd.to_numeric(titles.astype(str).str.extract(r"\((\d{4})\)\s*$")[0], errors="coerce")
    start = (year // 5 * 5).astype("Int64")
    bucket = start.astype(str) + "-" + (start + 4).astype(str)
    bucket = bucket.where(year >= 1930, "<1930").where(year.notna(), "unknown")
    return bucket


def read_events(raw: Path) -> EventLog:
    path = raw / "ratings.csv"
    ratings = read_table(path, ["userId", "movieId", "rating", "timestamp"])
    require_non_null(path, ratings, ["userId", "movieId", "rating", "timestamp"])
    rating = parse_numeric(path, ratings["rating"], "rating")
    fail_rows(path, "rating", (rating < 0.5) | (rating > 5.0), ratings["rating"], "rating outside [0.5, 5]")
    users = parse_numeric(path, ratings["userId"], "userId").astype(np.int64)
    items = parse_numeric(path, ratings["movieId"], "movieId").astype(np.int64)
    like = (rating >= 4.0).astype(np.int8)
    love = (rating >= 4.5).astype(np.int8)
    return EventLog(
        users=users,
        items=items,
        timestamps=parse_timestamps(path, ratings["timestamp"], "timestamp", "s")[0],
        labels={"like": like, "love": love},
        actions={"rating": (rating / 5.0).astype(np.float32), "like": like, "love": love},
    )


def read_items(raw: Path, tags_before: int) -> SideTable:
    path = raw / "movies.csv"
    movies = read_table(path, ["movieId", "title", "genres"])
    require_non_null(path, movies, ["movieId"])
    movie_ids = parse_numeric(path, movies["movieId"], "movieId").astype(np.int64)
    features = [
        categorical_from_strings("item_genres", movies["genres"], drop=("", NO_GENRE)),
        categorical_from_strings("item_year", year_bucket(movies["title"]), sep=None),
    ]
    tag_path = raw / "tags.csv"
    if tag_path.is_file():
        tags = read_table(tag_path, ["userId", "movieId", "tag", "timestamp"])
        require_non_null(tag_path, tags, ["movieId", "timestamp"])
        tag_time, _ = parse_timestamps(tag_path, tags["timestamp"], "timestamp", "s")
        tags = tags[tag_time < tags_before]
        text = tags["tag"].astype(str).str.strip().str.lower().str.replace("|", " ", regex=False)
        per_movie = text.groupby(tags["movieId"].astype(np.int64)).agg("|".join)
        movie_tags = pd.Series(movie_ids).map(per_movie)
        features.append(categorical_from_strings("item_tags", movie_tags))
    return SideTable(source=str(path), raw_ids=movie_ids, categorical=features)


def prepare_movielens(
    out: Path, raw: Path | None = None, split: SplitConfig | None = None, overwrite: bool = False, progress: bool = True
) -> Path:
    raw = resolve_raw_dir(raw)
    checksums = verify_checksums(raw, ["ratings.csv", "movies.csv", "tags.csv"])
    split = split or SplitConfig()
    events = read_events(raw)
    items = read_items(raw, tags_before=split.cutoff_for(events.timestamps))
    return build_dataset(
        out,
        name=NAME,
        events=events,
        items=items,
        split=split,
        # The user's earlier means on the target's genres (docs/benchmarks.md issue 21).
        aggregate_category="item_genres",
        input_checksums=checksums,
        extra={"source": {"raw_dir": str(raw), "url": URL}},
        overwrite=overwrite,
        progress=progress,
    )
