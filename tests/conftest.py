import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gemrec.components.common import ports

REPO_ROOT = Path(__file__).resolve().parent.parent


def movielens_raw_dir() -> Path | None:
    candidates = []
    if os.environ.get("GEMREC_DATA_DIR"):
        candidates.append(Path(os.environ["GEMREC_DATA_DIR"]) / "movielens-latest-small")
    candidates.append(REPO_ROOT.parent / "shared" / "data" / "movielens-latest-small")
    return next((p for p in candidates if (p / "ratings.csv").exists()), None)


@pytest.fixture(scope="session")
def movielens_raw() -> Path:
    """The raw ml-latest-small folder (read-only: never write into it)."""
    path = movielens_raw_dir()
    if path is None:
        pytest.skip("ml-latest-small not found (set GEMREC_DATA_DIR or place ../shared/data)")
    return path


@pytest.fixture
def free_port() -> int:
    return ports.free_port()


@pytest.fixture(scope="session")
def movielens_dataset(movielens_raw, tmp_path_factory) -> Path:
    """ml-latest-small prepared once per session (default split); the dataset folder (Dataset.open it)."""
    from gemrec.components.data_service.movielens import prepare_movielens

    return prepare_movielens(tmp_path_factory.mktemp("datasets") / "movielens", raw=movielens_raw, progress=False)


@pytest.fixture(scope="session")
def synth_dataset(tmp_path_factory) -> Path:
    """A small synthetic dataset (30k events, hashed item ids, planted sequence signals), once per session."""
    from gemrec.components.data_service.builder import SplitConfig
    from gemrec.components.data_service.synth import SynthConfig, synthesize

    config = SynthConfig(
        events=30_000,
        seed=7,
        mean_length=60,
        max_length=2_000,
        items=6_000,
        item_hash_buckets=4_096,
        categories=40,
        brands=300,
        tags=200,
    )
    return synthesize(
        tmp_path_factory.mktemp("datasets") / "synth",
        config,
        split=SplitConfig(eval_fraction=0.1, by="events"),
        progress=False,
    )


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory):
    """A self-signed certificate for localhost/127.0.0.1 and its key (PEM paths)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder = tmp_path_factory.mktemp("tls")
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


# Prepended to scripts run by `run_without_torchrec`: `import torchrec` (and fbgemm_gpu) fail, as on the GPU machine.
_BLOCK_TORCHREC = """
import importlib.abc
import sys

class BlockTorchrec(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchrec" or name.startswith("torchrec.") or name.startswith("fbgemm_gpu"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, BlockTorchrec())
"""
_TORCHREC_IMPORTED = """
assert not any(m == "torchrec" or m.startswith("torchrec.") for m in sys.modules), "torchrec was imported"
print("OK")
"""


@pytest.fixture
def run_without_torchrec():
    """`run(script, *args, timeout=...)`: run a Python script in a subprocess where torchrec cannot be imported; it
    passes when it exits 0 having never imported torchrec (returns the CompletedProcess)."""

    def run(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        code = _BLOCK_TORCHREC + textwrap.dedent(script) + _TORCHREC_IMPORTED
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.strip().endswith("OK")
        return result

    return run
