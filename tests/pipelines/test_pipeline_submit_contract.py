"""Contract test of `gemrec pipeline submit`: a recording HTTP endpoint plays the KFP v2beta1 API and we
check what the kfp client sent (no KFP server can run here)."""

from gemrec.cli import main


def kfp_api(endpoint):
    endpoint.route("GET", "/apis/v2beta1/healthz", lambda r: (200, {"multi_user": False, "tag_name": "2.5.0"}))
    endpoint.route("GET", "/apis/v2beta1/experiments", lambda r: (200, {}))
    endpoint.route(
        "POST",
        "/apis/v2beta1/experiments",
        lambda r: (200, {"experiment_id": "exp-1", "display_name": r["body"]["display_name"]}),
    )
    endpoint.route(
        "POST", "/apis/v2beta1/runs", lambda r: (200, {"run_id": "run-42", "experiment_id": r["body"]["experiment_id"]})
    )


def submit(endpoint, capsys, *extra):
    code = main(["pipeline", "submit", "--host", endpoint.url, *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_submit_creates_experiment_and_run_with_the_compiled_pipeline(recording_endpoint, capsys):
    kfp_api(recording_endpoint)
    code, out, err = submit(
        recording_endpoint, capsys, "--experiment", "nightly", "--arguments", '{"num_nodes": 2, "recipe": "movielens"}'
    )
    assert code == 0, err
    assert "submitted run run-42" in out
    sent = {(r["method"], r["path"].split("?")[0]): r for r in recording_endpoint.requests}
    assert sent[("POST", "/apis/v2beta1/experiments")]["body"] == {"display_name": "nightly"}
    run = sent[("POST", "/apis/v2beta1/runs")]["body"]
    assert run["experiment_id"] == "exp-1"
    assert run["display_name"].startswith("gemrec-train movielens ")
    assert run["runtime_config"]["parameters"] == {"num_nodes": 2, "recipe": "movielens"}
    pipeline_spec = run["pipeline_spec"]["pipeline_spec"]
    assert pipeline_spec["pipelineInfo"]["name"] == "gemrec-train"
    assert "train" in pipeline_spec["components"]["comp-train"]["executorLabel"]
    executors = run["pipeline_spec"]["platform_spec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert all("pvcMount" in e for e in executors.values())


def test_submit_reports_a_server_error_in_one_line(recording_endpoint, capsys):
    kfp_api(recording_endpoint)
    recording_endpoint.routes.insert(
        0, ("POST", "/apis/v2beta1/runs", lambda r: (400, {"error": "invalid pipeline spec", "code": 3}))
    )
    code, out, err = submit(recording_endpoint, capsys)
    assert code == 2
    assert "submitting to" in err and "400" in err
    assert "Traceback" not in err


def test_submit_rejects_bad_arguments_before_contacting_the_server(recording_endpoint, capsys):
    code, out, err = submit(recording_endpoint, capsys, "--arguments", "[1, 2]")
    assert code == 2 and "JSON object" in err
    assert recording_endpoint.requests == []
