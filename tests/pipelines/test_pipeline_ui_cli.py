"""`gemrec ui` refuses what cannot work before starting a server."""

import socket

from gemrec.cli import main
from gemrec.pipelines import ui


def test_missing_store_is_named(tmp_path, capsys):
    code = main(["ui", "--port", "0", "--tracking-uri", f"sqlite:///{tmp_path}/none.db"])
    err = capsys.readouterr().err
    assert code == 2 and f"no MLflow store at {tmp_path}/none.db" in err and "gemrec pipeline run" in err


def test_port_in_use_is_named(tmp_path, capsys):
    (tmp_path / "mlruns.db").touch()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        code = main(["ui", "--port", str(port), "--tracking-uri", f"sqlite:///{tmp_path}/mlruns.db"])
    err = capsys.readouterr().err
    assert code == 2 and f"port {port} on 127.0.0.1 is already in use (wanted by the MLflow UI)" in err


def test_server_serves_the_store_and_its_artifacts_on_loopback(tmp_path):
    command = ui.server_command(f"sqlite:///{tmp_path}/mlruns.db", 5123)
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--backend-store-uri") + 1] == f"sqlite:///{tmp_path}/mlruns.db"
    assert command[command.index("--artifacts-destination") + 1] == str(tmp_path / "mlartifacts")
