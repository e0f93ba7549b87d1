"""Atomic checkpoints with torch.distributed.checkpoint (DCP).

Layout: `DIR/step_00000040/` (DCP shards + `meta.json`) and `DIR/latest` (the name of the newest
complete checkpoint). Every rank writes into `DIR/.step_N.tmp/`; rank 0 then writes `meta.json`,
renames the folder into place and swaps `latest` with `os.replace`, so a crash at any moment leaves
the previous checkpoint complete and pointed to.

`DIR/healthy` names the newest checkpoint whose next training step was healthy (finite loss): a
checkpoint written right after a diverging update holds finite but exploded weights, and only the next
step shows it. When training stops on a non-finite loss, `DIR/diverged.json` records it and `--resume`
starts from the healthy checkpoint instead of the newest; pruning never removes the healthy one.

`DIR/best` names the checkpoint with the best validation (early stopping, `evaluate.EarlyStopping`): the weights a
run ends with and exports, also when `--resume` finishes a run that already ended; pruning never removes it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch.distributed.checkpoint as dcp

log = logging.getLogger(__name__)

LATEST = "latest"
HEALTHY = "healthy"
BEST = "best"
DIVERGED = "diverged.json"
# Model entries newer than some checkpoints whose initial value is their meaning: a checkpoint without them loads
# and they keep it (the task heads' logit offset, 0 = none, came with the valid-split calibration).
DEFAULTED_MODEL_KEYS = ("heads.logit_offset",)


class CheckpointError(RuntimeError):
    """The checkpoint directory cannot be used."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class CheckpointManager:
    def __init__(
        self,
        directory: Path,
        keep: int,
        rank: int = 0,
        barrier: Callable[[], None] = lambda: None,
        every: int = 0,
    ):
        """`every`: steps between checkpoints (0 = none; the last step is always saved when > 0)."""
        self.dir = Path(directory)
        self.keep = keep
        self.rank = rank
        self.barrier = barrier
        self.every = every
        self.seconds = 0.0  # wall time of the last `save`, barriers included (the train loop leaves it out)

    def due(self, step: int, last: bool) -> bool:
        return bool(self.every) and (step % self.every == 0 or last)

    def step_dir(self, step: int) -> Path:
        return self.dir / f"step_{step:08d}"

    def check_writable(self) -> None:
        """On every rank at start: the directory can be created and written (not found out at the first save)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-rank{self.rank}-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise CheckpointError(
                f"checkpoint directory {self.dir} is not writable ({err.strerror or err}): pass another --run-dir "
                "or set checkpoint.every=0"
            ) from None

    def _pointed(self, name: str) -> Path | None:
        pointer = self.dir / name
        if pointer.exists():
            path = self.dir / pointer.read_text().strip()
            if (path / "meta.json").exists():
                return path
        return None

    def healthy(self) -> Path | None:
        """The newest checkpoint whose next step had a finite loss, or None."""
        return self._pointed(HEALTHY)

    def mark_healthy(self, path: Path) -> None:
        if self.rank == 0:
            _write_atomic(self.dir / HEALTHY, path.name)
            (self.dir / DIVERGED).unlink(missing_ok=True)

    def best(self) -> Path | None:
        """The checkpoint with the best validation so far, or None."""
        return self._pointed(BEST)

    def mark_best(self, path: Path) -> None:
        """`path` validated best: also healthy (its weights gave finite validation losses)."""
        if self.rank == 0:
            _write_atomic(self.dir / BEST, path.name)
        self.mark_healthy(path)

    def mark_diverged(self, step: int, why: str) -> None:
        if self.rank == 0 and self.dir.is_dir():
            _write_atomic(self.dir / DIVERGED, json.dumps({"step": step, "why": why}))

    def diverged(self) -> dict | None:
        path = self.dir / DIVERGED
        return json.loads(path.read_text()) if path.exists() else None

    def resume_point(self) -> Path | None:
        """Where `--resume` starts: the newest checkpoint, or after a divergence the last healthy one."""
        return self.healthy() if self.diverged() else self.latest()

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        path = self._pointed(LATEST)
        if path is not None:
            return path
        complete = sorted(p for p in self.dir.glob("step_*") if (p / "meta.json").exists())
        return complete[-1] if complete else None

    def clear(self) -> None:
        self.barrier()  # every rank is done with the directory (`check_writable`'s probe) before it goes
        if self.rank == 0 and self.dir.exists():
            shutil.rmtree(self.dir)
        self.barrier()

    def save(self, step: int, state: dict, meta: dict | None = None) -> Path:
        begin = time.perf_counter()
        final = self.step_dir(step)
        tmp = self.dir / f".{final.name}.tmp"
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        self.barrier()
        start = time.perf_counter()
        with warnings.catch_warnings():  # alone, DCP warns that it saves "in a single process": intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(tmp))
        self.barrier()
        if self.rank == 0:
            _write_atomic(tmp / "meta.json", json.dumps({"step": step, "time": time.time(), **(meta or {})}))
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.dir)
            _write_atomic(self.dir / LATEST, final.name)
            self._prune()
            log.info("checkpoint step %d -> %s (%.2fs)", step, final, time.perf_counter() - start)
        self.barrier()
        self.seconds = time.perf_counter() - begin
        return final

    def _prune(self) -> None:
        complete = sorted(p for p in self.dir.glob("step_*") if (p / "meta.json").exists())
        pinned = {self.healthy(), self.best()}
        for old in complete[: -self.keep]:
            if old not in pinned:
                shutil.rmtree(old, ignore_errors=True)

    def sections(self, path: Path) -> set[str]:
        """The top-level entries of a checkpoint's state ("model", "optim", ...)."""
        return {key.split(".", 1)[0] for key in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata}

    def load(self, state: dict, path: Path | None = None) -> dict:
        """Load in place into `state` (a template with the right keys and shapes: all of the checkpoint's or some,
        e.g. only "model"); returns meta.json."""
        path = path or self.latest()
        if path is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.dir}")
        model = state.get("model", {})
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        absent = [key for key in model if f"model.{key}" not in saved]
        foreign = [key for key in absent if not key.endswith(DEFAULTED_MODEL_KEYS)]
        if foreign:
            raise CheckpointError(f"checkpoint {path} lacks model entries {foreign}: it was written for another model")
        kept = {key: model.pop(key) for key in absent}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, checkpoint_id=str(path))
        finally:
            model.update(kept)
        if kept:
            log.info("checkpoint %s predates %s: they keep their initial values", path, sorted(kept))
        return json.loads((path / "meta.json").read_text())
