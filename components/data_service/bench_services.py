"""`gemrec bench services`: feature service latency and throughput (memory vs Redis), data stream rates.

Servers run as real `gemrec serve ...` processes on 127.0.0.1 (so client and server do not share a GIL);
load generators for the concurrency sweep are separate processes too. Results: a table on stdout and
`<out>/services.json`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gemrec.components.common.grpc_channel import open_channel, wait_healthy
from gemrec.components.common.ports import free_port
from gemrec.provenance import git_commit


def _serve(args: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gemrec.cli", "serve", *args, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with open_channel(f"127.0.0.1:{port}") as channel:
        try:
            wait_healthy(channel, timeout_s=120)
        except TimeoutError:
            proc.kill()
            raise
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _percentiles(latencies_s: list[float]) -> dict:
    ms = np.asarray(latencies_s) * 1e3
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "mean_ms": round(float(ms.mean()), 3),
        "requests": len(ms),
    }


def _load_worker(address: str, num_ids: int, seconds: float, barrier, results) -> None:
    """One load-generating process: single-id lookups of all item features for `seconds`, no retries;
    puts (requests, elapsed s, errors, latencies in s), or the exception that stopped it."""
    import grpc
    from gemrec.components.feature_service.client import FeatureClient

    rng = np.random.default_rng()
    latencies, errors = [], 0
    try:
        with FeatureClient(address, retries=8) as warm:  # connecting may be slow on a loaded machine
            warm.lookup("item", [0])
        with FeatureClient(address, retries=0) as client:
            client.lookup("item", [0])
            barrier.wait()
            start = time.perf_counter()
            while (sent := time.perf_counter()) - start < seconds:
                try:
                    client.lookup("item", rng.integers(0, num_ids, size=1))
                except grpc.RpcError:
                    errors += 1
                latencies.append(time.perf_counter() - sent)
            results.put((len(latencies), time.perf_counter() - start, errors, np.asarray(latencies, np.float32)))
    except Exception as err:
        barrier.abort()
        results.put(RuntimeError(f"load client failed: {type(err).__name__}: {err}"))


def _drive(address: str, num_ids: int, clients: int, seconds: float) -> list[tuple]:
    """`clients` load processes at once; their (requests, elapsed, errors, latencies)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(clients), ctx.Queue()
    procs = [
        ctx.Process(target=_load_worker, args=(address, num_ids, seconds, barrier, results)) for _ in range(clients)
    ]
    for p in procs:
        p.start()
    done = [results.get(timeout=seconds + 300) for _ in procs]
    for p in procs:
        p.join()
    failed = [d for d in done if isinstance(d, Exception)]
    if failed:
        raise failed[0]
    return done


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmRSS for pid {pid}")


def bench_load(address: str, pid: int, clients: list[int], seconds: float) -> list[dict]:
    """Sustained load: per client count, total req/s, latency percentiles, errors and the server's RSS
    before and after."""
    from gemrec.components.feature_service.client import FeatureClient

    with FeatureClient(address) as client:
        num_items = client.list_features()["item"]["num_ids"]
    rows = []
    for n in clients:
        rss_start, load_start = _rss_mb(pid), os.getloadavg()[0]
        done = _drive(address, num_items, n, seconds)
        latencies = np.concatenate([d[3] for d in done])
        rows.append(
            {
                "clients": n,
                "seconds": seconds,
                "qps": round(sum(d[0] / d[1] for d in done), 1),
                **{k: v for k, v in _percentiles(latencies).items() if k != "requests"},
                "requests": int(sum(d[0] for d in done)),
                "errors": int(sum(d[2] for d in done)),
                "rss_start_MB": rss_start,
                "rss_end_MB": _rss_mb(pid),
                "load_avg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_features(address: str, requests: int, seconds: float, concurrency: list[int]) -> dict:
    from gemrec.components.feature_service.client import FeatureClient

    rng = np.random.default_rng(0)
    result = {}
    with FeatureClient(address) as client:
        entities = client.list_features()
        num_items = entities["item"]["num_ids"]
        result["item_features"] = len(entities["item"]["features"])
        for n in (1, 512):
            for _ in range(50):  # warm-up
                client.lookup("item", rng.integers(0, num_items, size=n))
            latencies = []
            for _ in range(requests if n == 1 else max(200, requests // 4)):
                ids = rng.integers(0, num_items, size=n)
                start = time.perf_counter()
                client.lookup("item", ids)
                latencies.append(time.perf_counter() - start)
            result[f"latency_{n}_ids"] = _percentiles(latencies)
    for clients in concurrency:
        qps = sum(count / elapsed for count, elapsed, _, _ in _drive(address, num_items, clients, seconds))
        result[f"throughput_{clients}_clients_qps"] = round(qps, 1)
    return result


def bench_stream(address: str, max_seq_len: int, batch_size: int, seconds: float) -> dict:
    from gemrec.components.data_service.client import DataClient

    client = DataClient(address, "train", batch_size=batch_size, max_seq_len=max_seq_len, seed=0, prefetch=4)
    samples = tokens = nbytes = batches = 0
    start = None
    for batch in client:
        if start is None:  # the first batch pays connection and plan set-up
            start = time.perf_counter()
            continue
        samples += batch.batch_size
        tokens += batch.num_tokens
        nbytes += client.last_info.nbytes
        batches += 1
        if time.perf_counter() - start > seconds:
            break
    client.close()
    elapsed = time.perf_counter() - start
    return {
        "max_seq_len": max_seq_len,
        "batch_size": batch_size,
        "batches": batches,
        "samples_per_s": round(samples / elapsed, 1),
        "tokens_per_s": round(tokens / elapsed),
        "payload_MB_per_s": round(nbytes / elapsed / 1e6, 1),
        "MB_per_batch": round(nbytes / batches / 1e6, 2),
    }


def bench_balance(dataset, world_size: int, batch_size: int, max_seq_len: int, steps: int) -> dict:
    from .service import DataLoaderCore, StreamRequest

    core = DataLoaderCore(dataset)
    key = core.plan(StreamRequest("train", 0, world_size, batch_size, max_seq_len, 0, 0, True)).key
    parts = [core.step_rows(key, s)[1] for s in range(steps)]
    return {
        "world_size": world_size,
        "batch_size": batch_size,
        "max_seq_len": max_seq_len,
        "steps": steps,
        "balanced_cost_max_over_mean": round(float(np.mean([p.cost_imbalance for p in parts])), 6),
        "contiguous_cost_max_over_mean": round(float(np.mean([p.naive_cost_imbalance for p in parts])), 6),
    }


def _features_dataset(args, out: Path) -> Path:
    from gemrec.cli import CLIError

    from .errors import DataError
    from .movielens import prepare_movielens

    features = Path(args.dataset) if args.dataset else out / "movielens"
    if not (features / "manifest.json").is_file():
        if args.dataset:
            raise CLIError(f"{features}: not a dataset directory (no manifest.json)")
        try:
            prepare_movielens(features, overwrite=True)
        except DataError as err:
            raise CLIError(f"cannot prepare MovieLens for the feature benchmark: {err} (or pass --dataset)") from None
    return features


def _synth_dataset(args, out: Path) -> Path:
    from .builder import SplitConfig
    from .synth import SynthConfig, synthesize

    synth = out / f"synth-{args.synth_events}"
    if not (synth / "manifest.json").is_file():
        synthesize(
            synth,
            SynthConfig(events=args.synth_events, seed=0),
            split=SplitConfig(eval_fraction=0.1, by="events"),
            overwrite=True,
        )
    return synth


def _redis(out: Path):
    binary = shutil.which("redis-server")
    if binary is None:
        return None, None
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(out)],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def run(args) -> int:
    from gemrec.components.feature_service.store import MemoryStore, materialize

    from .dataset import Dataset

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    features_dir = _features_dataset(args, out)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": _machine(),
        "commit": git_commit(short=True),
        "features_dataset": str(features_dir),
        "feature_service": {},
    }

    stores = ["memory"]
    redis_proc, redis_url = (None, None) if args.skip_redis else _redis(out)
    try:
        if redis_url:
            report["materialize"] = materialize(MemoryStore(features_dir), redis_url, progress=False)
            stores.append("redis")
        for store in stores:
            port = free_port()
            extra = ["--store", store] + (["--redis-url", redis_url] if store == "redis" else [])
            proc = _serve(["features", "--dataset", str(features_dir), *extra], port)
            address = f"127.0.0.1:{port}"
            try:
                print(f"feature service, {store} store ...", flush=True)
                if args.load:
                    report["feature_service"][store] = bench_load(address, proc.pid, args.load_clients, args.load_s)
                else:
                    report["feature_service"][store] = bench_features(
                        address, args.requests, args.seconds, args.concurrency
                    )
            finally:
                _stop(proc)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=30)
    if args.load:
        (out / "services-load.json").write_text(json.dumps(report, indent=2) + "\n")
        _print_load(report)
        return 0

    synth_dir = _synth_dataset(args, out)
    report["data_dataset"] = str(synth_dir)
    report["data_service"] = []
    port = free_port()
    proc = _serve(["data", "--dataset", str(synth_dir), "--prefetch", "4"], port)
    try:
        for max_seq_len in (256, 4096):
            print(f"data stream, max_seq_len {max_seq_len} ...", flush=True)
            report["data_service"].append(bench_stream(f"127.0.0.1:{port}", max_seq_len, args.batch_size, args.seconds))
    finally:
        _stop(proc)
    synth = Dataset.open(synth_dir)
    report["data_dataset_history_length"] = synth.manifest["splits"]["train"]["history_length"]
    report["balance"] = [bench_balance(synth, 8, 32, 4096, 50), bench_balance(synth, 8, 256, 4096, 20)]

    (out / "services.json").write_text(json.dumps(report, indent=2) + "\n")
    _print(report)
    return 0


def _machine() -> str:
    import os

    cpu = platform.processor() or platform.machine()
    return f"{platform.node()} {cpu} {os.cpu_count()} cores, Python {platform.python_version()}"


def _print(report: dict) -> None:
    print(f"\n{report['date']}  commit {report['commit']}  {report['machine']}")
    print("| store | ids | p50 ms | p99 ms | mean ms |")
    print("|---|---|---|---|---|")
    for store, r in report["feature_service"].items():
        for n in (1, 512):
            lat = r[f"latency_{n}_ids"]
            cells = [f"{n} x {r['item_features']} features", lat["p50_ms"], lat["p99_ms"], lat["mean_ms"]]
            print(f"| {store} | " + " | ".join(str(c) for c in cells) + " |")
    print(
        "| store | "
        + " | ".join(k for k in next(iter(report["feature_service"].values())) if k.startswith("throughput"))
        + " |"
    )
    for store, r in report["feature_service"].items():
        print(f"| {store} | " + " | ".join(str(v) for k, v in r.items() if k.startswith("throughput")) + " |")
    print("| max_seq_len | batch | samples/s | tokens/s | payload MB/s | MB/batch |")
    print("|---|---|---|---|---|---|")
    for r in report["data_service"]:
        print(
            f"| {r['max_seq_len']} | {r['batch_size']} | {r['samples_per_s']} | {r['tokens_per_s']} | "
            f"{r['payload_MB_per_s']} | {r['MB_per_batch']} |"
        )
    for r in report["balance"]:
        print(
            f"balance W={r['world_size']} B={r['batch_size']} L<={r['max_seq_len']}: cost max/mean "
            f"{r['balanced_cost_max_over_mean']} balanced vs {r['contiguous_cost_max_over_mean']} contiguous"
        )


def _print_load(report: dict) -> None:
    print(f"\n{report['date']}  commit {report['commit']}  {report['machine']}")
    print("| store | clients | req/s | p50 ms | p99 ms | errors | server RSS start -> end MB | load avg |")
    print("|---|---|---|---|---|---|---|---|")
    for store, rows in report["feature_service"].items():
        for r in rows:
            cells = [r["clients"], r["qps"], r["p50_ms"], r["p99_ms"], r["errors"]]
            cells += [f"{r['rss_start_MB']} -> {r['rss_end_MB']}", " -> ".join(map(str, r["load_avg_1min"]))]
            print(f"| {store} | " + " | ".join(str(c) for c in cells) + " |")
