"""Local service processes: started in their own process group, stopped with everything they spawned."""

import os
import socket
import sys
import time

import pytest
from gemrec.components.common.ports import free_port
from gemrec.pipelines.services import ProcessGroup, ServiceError, claim_port, claim_ports, wait_serving

SPAWNER = """
import signal, subprocess, sys, time
if sys.argv[1] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("child", child.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def start_spawner(group: ProcessGroup, tmp_path, mode: str = "normal") -> tuple[int, int]:
    log = tmp_path / f"spawner-{mode}.log"
    process = group.start("spawner", [sys.executable, "-c", SPAWNER, mode], log)
    deadline = time.monotonic() + 30
    while "child" not in log.read_text():
        assert time.monotonic() < deadline, "spawner did not start"
        time.sleep(0.05)
    child = int(log.read_text().split()[1])
    return process.pid, child


def wait_dead(pids, timeout=15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_leaving_the_group_stops_processes_and_their_children(tmp_path):
    with ProcessGroup() as group:
        pids = start_spawner(group, tmp_path)
        assert all(alive(p) for p in pids)
    assert wait_dead(pids) == []


def test_an_error_inside_the_group_still_stops_everything(tmp_path):
    with pytest.raises(RuntimeError, match="training failed"), ProcessGroup() as group:
        pids = start_spawner(group, tmp_path)
        raise RuntimeError("training failed")
    assert wait_dead(pids) == []


def test_a_process_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    started = time.monotonic()
    with ProcessGroup(grace_s=0.5) as group:
        pids = start_spawner(group, tmp_path, "ignore-term")
    assert wait_dead(pids) == []
    assert time.monotonic() - started < 20


def test_sigterm_to_the_step_runs_the_cleanup(tmp_path):
    """A cancelled step (SIGTERM) stops its services before exiting."""
    with pytest.raises(KeyboardInterrupt), ProcessGroup() as group:
        pids = start_spawner(group, tmp_path)
        os.kill(os.getpid(), 15)
        time.sleep(5)
    assert wait_dead(pids) == []


def test_a_service_that_dies_at_start_fails_fast_with_its_log(tmp_path):
    started = time.monotonic()
    with (
        pytest.raises(ServiceError, match=r"(?s)the feature service exited with code 3 .*dataset is broken"),
        ProcessGroup() as group,
    ):
        process = group.start(
            "feature service",
            [sys.executable, "-c", "import sys; print('dataset is broken'); sys.exit(3)"],
            tmp_path / "features.log",
        )
        wait_serving(process, "127.0.0.1:1", timeout_s=60)
    assert time.monotonic() - started < 30


def test_a_port_in_use_is_named():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(
            ServiceError, match=f"port {port} on 127.0.0.1 is already in use \\(wanted by the data service\\)"
        ):
            claim_port(port, "data service")
    assert claim_port(0, "data service") > 0


def test_services_asking_for_any_port_get_different_ones():
    for _ in range(200):  # the OS may hand out a just-released port again: each claim must still differ
        feature, data = claim_ports([(0, "feature service"), (0, "data service")])
        assert feature != data


def test_two_services_asking_for_one_port_are_refused():
    port = free_port()
    with pytest.raises(ServiceError, match=f"the feature service and the data service cannot share port {port}"):
        claim_ports([(port, "feature service"), (port, "data service")])
    feature, data = claim_ports([(port, "feature service"), (0, "data service")])
    assert (feature, data != port) == (port, True)


def test_progress_bars_become_throttled_lines(tmp_path, capfd):
    """A child's carriage-return progress bar reaches the console as a few lines, all of it reaches the log."""
    code = (
        "import sys, time\n"
        "for i in range(40):\n"
        "    sys.stderr.write(f'\\rstep {i}/40'); sys.stderr.flush(); time.sleep(0.02)\n"
        "print('\\neval NE 0.83', flush=True)\n"
    )
    with ProcessGroup() as group:
        process = group.start("trainer", [sys.executable, "-c", code], tmp_path / "trainer.log", echo=True)
        assert process.stream(progress_every_s=0.3) == 0
    lines = capfd.readouterr().out.splitlines()
    assert lines[0] == "step 0/40" and lines[-1] == "eval NE 0.83"
    assert 3 <= len(lines) <= 10, lines
    assert "step 39/40" in lines
    assert (tmp_path / "trainer.log").read_bytes().count(b"\rstep") == 40


def test_the_trainer_error_line_is_found_under_torchrun_prefixes(tmp_path):
    from gemrec.pipelines.steps import last_error

    log = tmp_path / "trainer.log"
    log.write_text(
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "x.py", line 1, in <module>\n'
        "[rank1]: ValueError: batch of 0 examples\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    assert last_error(log) == "[rank1]: ValueError: batch of 0 examples"
    log.write_text("gemrec train: error: data.batch_size must be > 0\nValueError: later noise\n")
    assert last_error(log) == "gemrec train: error: data.batch_size must be > 0"
    assert last_error(tmp_path / "missing.log") == "no log"


def test_train_step_refuses_a_broken_recipe_before_starting_services(tmp_path):
    from gemrec.pipelines import steps

    for text, problem in (
        ("[data]\nbatch_size = 0\n", "data.batch_size = 0: must be > 0"),
        ("[model]\nd_model = 30\nnum_heads = 4\n", "model.d_model = 30: must be divisible by num_heads 4"),
    ):
        recipe = tmp_path / "broken.toml"
        recipe.write_text(text)
        with pytest.raises(steps.StepError, match=rf"recipe '.*broken.toml': .*{problem}"):
            spec = steps.TrainSpec(
                recipe=str(recipe),
                tracking_uri=f"sqlite:///{tmp_path}/mlruns.db",
                experiment="e",
                run_dir=str(tmp_path / "run"),
            )
            steps.train_local(spec, str(tmp_path), {}, str(tmp_path / "metrics.json"))
        assert not (tmp_path / "run").exists()  # no service was started, no log written


def test_train_spec_refuses_bad_values_by_name():
    from gemrec.config import ConfigError
    from gemrec.pipelines import steps

    with pytest.raises(ConfigError, match="train_step.mode = 'cloud': must be one of 'local', 'pod', 'trainjob'"):
        steps.TrainSpec(mode="cloud")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="train_step.nproc = 0: must be at least 1"):
        steps.TrainSpec.from_inputs({"nproc": 0, "dataset": "ignored: not a spec field"})
