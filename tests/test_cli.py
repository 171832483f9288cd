"""The command line: ``python -m paged_kv fragmentation``, ``simulate``, ``check-env`` and ``serve``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from paged_kv import env_check
from paged_kv.cli import build_parser, main
from paged_kv.simulation.workload import compare_policies, format_table, sample_requests

from .test_fragmentation import SEED_REPORT

pytestmark = pytest.mark.setup


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "paged_kv", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=None if env is None else {**os.environ, **env},
    )


def test_fragmentation_prints_the_seeds_benchmark():
    result = run_cli(
        "fragmentation", "--block-size", "16", "--total-blocks", "64", "--request-tokens", "9,17,33,5,41,12"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == SEED_REPORT
    # Same fields in the same order as the seed: keys sorted, two-space indent.
    assert result.stdout == json.dumps(SEED_REPORT, indent=2, sort_keys=True) + "\n"


def test_fragmentation_defaults_are_the_seeds_arguments(capsys):
    assert main(["fragmentation"]) == 0
    assert json.loads(capsys.readouterr().out) == SEED_REPORT


def test_fragmentation_accepts_spaces_and_zero_token_requests(capsys):
    assert main(["fragmentation", "--block-size", "4", "--request-tokens", "0, 4 ,5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["request_tokens"] == [0, 4, 5]
    assert report["block_usage"]["used_blocks"] == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--request-tokens", "9,-3"], "negative number of tokens, got -3"),
        (["--request-tokens", "9,abc"], "expected comma-separated whole numbers"),
        (["--request-tokens", "9,,3"], "expected comma-separated whole numbers"),
        (["--request-tokens", "2.5"], "expected comma-separated whole numbers"),
        (["--block-size", "0"], "--block-size: expected a number of at least 1"),
        (["--total-blocks", "-2"], "--total-blocks: expected a number of at least 1"),
        (["--total-blocks", "x"], "--total-blocks: expected a whole number"),
        (
            ["--total-blocks", "2", "--request-tokens", "40"],
            "need 3 blocks of 16 tokens but --total-blocks is 2",
        ),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fragmentation", *args])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("python -m paged_kv")
    assert ": error: " in lines[0] and message in lines[0]


def test_a_bad_argument_never_shows_a_traceback():
    result = run_cli("fragmentation", "--total-blocks", "1", "--request-tokens", "17")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "python -m paged_kv fragmentation: error: "
        "the requests need 2 blocks of 16 tokens but --total-blocks is 1\n"
    )


def test_a_missing_or_unknown_command_exits_2(capsys):
    for args in ([], ["explode"]):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "fragmentation" in out and "simulate" in out and "check-env" in out


def test_check_env_reports_every_requirement():
    result = run_cli("check-env", env={"HF_HUB_OFFLINE": "1"})  # no network in the tests
    names = ["Python", "torch", "msgspec", "pyzmq", "ipywidgets", "matplotlib", "jupyterlab", "transformers"]
    names += ["nbval", "triton"]
    for name in [*names, "device"]:
        assert any(line.startswith(name) for line in result.stdout.splitlines()), name
    # The test environment is the course's own, so every requirement is met (triton's on Linux only).
    assert result.returncode == 0, result.stdout
    required = 11 if sys.platform == "linux" else 10
    assert f"result: OK ({required}/{required} checks passed)" in result.stdout
    hub = [line for line in result.stdout.splitlines() if line.startswith("HF Hub")]
    assert hub == [
        "HF Hub       offline by setting       INFO  "
        "(HF_HUB_OFFLINE=1: lesson 09 uses a random-weight stand-in)"
    ]


def test_check_env_marks_a_missing_package_as_fail():
    check = env_check.check_package("no-such-distribution-xyz", "1.0", "dev")
    assert not check.ok
    assert check.found == "not installed"
    assert "FAIL" in check.line() and "pip install -e '.[dev]'" in check.line()


def test_check_env_marks_an_old_package_as_fail(monkeypatch):
    monkeypatch.setattr(env_check.metadata, "version", lambda name: "1.13.1")
    check = env_check.check_package("torch", "2.4", "core")
    assert (check.ok, check.found) == (False, "1.13.1")
    assert "needs >= 2.4: pip install -e ." in check.line()


def test_report_fails_when_one_check_fails(monkeypatch):
    failing = env_check.Check("nbval", "not installed", False)
    monkeypatch.setattr(env_check, "run_checks", lambda: [env_check.check_python(), failing])
    text, ok = env_check.report()
    assert not ok
    assert text.splitlines()[-1] == "result: FAIL (1/2 checks passed)"


def not_installed(name: str) -> str:
    raise env_check.metadata.PackageNotFoundError(name)


def test_triton_is_a_requirement_on_linux(monkeypatch):
    monkeypatch.setattr(env_check.metadata, "version", not_installed)
    check = env_check.check_triton("linux")
    assert (check.found, check.ok, check.required) == ("not installed", False, True)
    assert check.line() == (
        "triton       not installed            FAIL  (needs >= 3.7: pip install -e '.[course]')"
    )
    monkeypatch.setattr(env_check.metadata, "version", lambda name: "3.6.0")
    assert not env_check.check_triton("linux").ok


@pytest.mark.parametrize(
    ("platform_name", "version"), [("darwin", None), ("win32", None), ("darwin", "3.9.0")]
)
def test_triton_is_information_off_linux_and_never_fails_the_report(monkeypatch, platform_name, version):
    monkeypatch.setattr(
        env_check.metadata, "version", not_installed if version is None else lambda n: version
    )
    check = env_check.check_triton(platform_name)
    found = version or "not installed"
    assert (check.found, check.required) == (found, False)
    assert check.line() == (
        f"triton       {found:<24} INFO  (Linux wheels only: on {platform_name} lesson 12's kernel "
        "cells and the Triton tests skip)"
    )
    python = env_check.check_python()
    monkeypatch.setattr(env_check, "run_checks", lambda: [python, check])
    text, ok = env_check.report()
    assert ok and text.splitlines()[-1] == "result: OK (1/1 checks passed)"


class FakeResponse:
    def __enter__(self) -> FakeResponse:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def fake_urlopen(outcome: object, requests: list):
    """An ``urlopen`` that records its request and timeout, then answers or raises ``outcome``."""

    def urlopen(request, timeout):
        requests.append((request, timeout))
        if isinstance(outcome, BaseException):
            raise outcome
        return FakeResponse()

    return urlopen


def test_hub_reachable_sends_one_head_request_with_no_token(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    requests: list = []
    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen(None, requests))
    assert env_check.hub_reachable() is True
    ((request, timeout),) = requests
    assert (request.full_url, request.get_method(), timeout) == ("https://huggingface.co", "HEAD", 3.0)
    assert not request.has_header("Authorization")
    assert env_check.hub_reachable(timeout=0.5) is True and requests[-1][1] == 0.5


@pytest.mark.parametrize(
    ("outcome", "reachable"),
    [
        (urllib.error.URLError("[Errno -2] Name or service not known"), False),
        (TimeoutError("timed out"), False),
        (ConnectionRefusedError(111, "Connection refused"), False),
        (ValueError("bad proxy URL"), False),
        (urllib.error.HTTPError("https://huggingface.co", 405, "Method Not Allowed", {}, None), True),
        (urllib.error.HTTPError("https://huggingface.co", 503, "Service Unavailable", {}, None), False),
    ],
)
def test_hub_reachable_is_false_when_nothing_or_a_server_error_answers(monkeypatch, outcome, reachable):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen(outcome, []))
    assert env_check.hub_reachable() is reachable


@pytest.mark.parametrize("value", ["1", "true", "ON", " yes "])
def test_hub_offline_by_setting_sends_no_request(monkeypatch, value):
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    requests: list = []
    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen(None, requests))
    assert env_check.hub_offline_by_setting()
    assert env_check.hub_reachable() is False
    check = env_check.check_hub()
    assert (check.found, check.required) == ("offline by setting", False)
    assert requests == []


@pytest.mark.parametrize("value", ["", "0", "false", "no"])
def test_hub_offline_is_off_for_other_values(monkeypatch, value):
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert not env_check.hub_offline_by_setting()


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), "3", True, None])
def test_hub_reachable_refuses_a_bad_timeout(timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        env_check.hub_reachable(timeout)


@pytest.mark.parametrize(
    ("outcome", "line"),
    [
        (
            None,
            "HF Hub       reachable                INFO  (https://huggingface.co: "
            "real weights can be downloaded)",
        ),
        (
            urllib.error.URLError("no route"),
            "HF Hub       not reachable            INFO  (no answer from https://huggingface.co: "
            "lesson 09 serves a random-weight stand-in instead of real weights)",
        ),
    ],
)
def test_the_hub_line_is_information_and_never_fails_the_report(monkeypatch, outcome, line):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen(outcome, []))
    monkeypatch.setattr(env_check, "check_device", lambda: env_check.Check("device", "cpu", True))
    text, ok = env_check.report()
    assert line in text.splitlines()
    assert ok
    # Python, the packages, triton where it is required (Linux), the device
    required = 1 + len(env_check.REQUIREMENTS) + (sys.platform == "linux") + 1
    assert text.splitlines()[-1] == f"result: OK ({required}/{required} checks passed)"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.13.0+cpu", (2, 13, 0)),
        ("8.1.9", (8, 1, 9)),
        ("0.11.0", (0, 11, 0)),
        ("4.6.0rc1", (4, 6, 0)),
        ("x", ()),
    ],
)
def test_version_tuple(text, expected):
    assert env_check.version_tuple(text) == expected


# ------------------------------------------------------------------------ simulate (lesson 07)


@pytest.mark.lesson07
def test_simulate_prints_the_comparison_table():
    result = run_cli("simulate")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    header, columns, rule, *rows = result.stdout.splitlines()
    assert header.startswith("workload sharegpt: 200 requests (mean prompt ")
    assert "budget 32768 tokens" in header and "seed 0" in header
    assert columns.split("  ")[0] == "policy" and columns.split()[-1] == "preemptions"
    assert set(rule) == {"-", " "}
    assert [row.split("  ")[0] for row in rows] == [
        "vLLM (blocks of 16)",
        "Orca (Max)",
        "Orca (Pow2)",
        "Orca (Oracle)",
    ]
    # The table is what the package computes for the same arguments.
    assert result.stdout.endswith(format_table(compare_policies("sharegpt", 200, 32768, 0)) + "\n")


@pytest.mark.lesson07
def test_simulate_passes_every_argument_through(capsys):
    args = ["--workload", "alpaca", "--num-requests", "30", "--budget-tokens", "1024"]
    args += ["--block-size", "8", "--arrival-rate", "0.5", "--seed", "3"]
    assert main(["simulate", *args]) == 0
    out = capsys.readouterr().out
    requests = sample_requests("alpaca", 30, seed=3, arrival_rate=0.5)
    mean_prompt = sum(r.prompt_tokens for r in requests) / 30
    assert out.splitlines()[0].startswith(f"workload alpaca: 30 requests (mean prompt {mean_prompt:.1f}, ")
    assert "arrivals 0.5 per step" in out.splitlines()[0]
    expected = compare_policies("alpaca", 30, 1024, seed=3, arrival_rate=0.5, block_size=8)
    assert out.endswith(format_table(expected) + "\n")
    assert "vLLM (blocks of 8)" in out


@pytest.mark.lesson07
def test_simulate_json_prints_the_shares_of_the_memory_for_each_policy():
    args = ["--workload", "alpaca", "--num-requests", "40", "--budget-tokens", "1024", "--seed", "2"]
    result = run_cli("simulate", "--json", *args)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {k: v for k, v in report.items() if k != "policies"} == {
        "workload": "alpaca",
        "num_requests": 40,
        "budget_tokens": 1024,
        "block_size": 16,
        "arrival_rate": None,
        "seed": 2,
    }
    expected = compare_policies("alpaca", 40, 1024, seed=2)
    assert [p["policy"] for p in report["policies"]] == [r.policy for r in expected]
    for policy, result in zip(report["policies"], expected, strict=True):
        assert policy == json.loads(json.dumps(result.summary()))
        shares = policy["memory_shares"]
        assert sum(shares["percent"].values()) == pytest.approx(100)
        parts = [shares[name] for name in shares["percent"]]
        assert sum(parts) == shares["capacity"] * shares["steps"] == 1024 * shares["steps"] > 0
        assert policy["steps"] == result.steps and policy["preemptions"] == result.preemptions
    assert report["policies"][3]["memory_shares"]["internal_fragmentation"] == 0  # Orca (Oracle)


@pytest.mark.lesson07
def test_simulate_json_says_null_when_no_request_ever_waited(capsys):
    assert main(["simulate", "--json", "--num-requests", "1", "--budget-tokens", "4096"]) == 0
    report = json.loads(capsys.readouterr().out)
    for policy in report["policies"]:
        assert policy["memory_shares"]["steps"] == 0 and policy["memory_shares"]["percent"] is None


@pytest.mark.lesson07
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "wikipedia"], "argument --workload: invalid choice: 'wikipedia'"),
        (["--num-requests", "0"], "--num-requests: expected a number of at least 1"),
        (["--budget-tokens", "lots"], "--budget-tokens: expected a whole number"),
        (["--block-size", "-16"], "--block-size: expected a number of at least 1"),
        (["--arrival-rate", "0"], "--arrival-rate: expected a positive number"),
        (["--arrival-rate", "nan"], "--arrival-rate: expected a positive number"),
        (["--arrival-rate", "fast"], "--arrival-rate: expected a number"),
        (["--seed", "-1"], "--seed: expected a number of at least 0"),
        (["--seed", "1.5"], "--seed: expected a whole number"),
        (
            ["--budget-tokens", "1000"],
            "--budget-tokens must hold one sequence of the maximum length, 2048 tokens for sharegpt",
        ),
        (
            ["--block-size", "40000"],
            "cannot hold request 0 alone: vLLM (blocks of 40000)",
        ),
    ],
)
def test_simulate_bad_arguments_give_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", *args])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("python -m paged_kv simulate: error: ")
    assert message in lines[0]


# ------------------------------------------------------------------------------ serve (lesson 16)


def test_serve_defaults_are_vllms_where_they_can_be():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.block_size) == ("127.0.0.1", 8000, 16)
    assert args.enable_prefix_caching is True  # vLLM v1's default
    assert args.model is None and args.tiny is False
    assert args.num_gpu_blocks_override is None and args.gpu_memory_utilization is None
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (None, None, None)
    assert args.uvicorn_log_level == "info"


def test_serve_takes_vllms_flags():
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "my-model",
            "--tiny",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--num-gpu-blocks-override",
            "64",
            "--block-size",
            "32",
            "--max-model-len",
            "128",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "256",
            "--no-enable-prefix-caching",
            "--uvicorn-log-level",
            "warning",
        ]
    )
    assert (args.model, args.tiny, args.host, args.port) == ("my-model", True, "0.0.0.0", 0)
    assert (args.num_gpu_blocks_override, args.block_size, args.max_model_len) == (64, 32, 128)
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (4, 256)
    assert args.enable_prefix_caching is False and args.uvicorn_log_level == "warning"
    assert (
        build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.5"]).gpu_memory_utilization == 0.5
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-gpu-blocks-override", "8", "--gpu-memory-utilization", "0.5"], "not allowed with argument"),
        (["--gpu-memory-utilization", "1.5"], "expected a fraction in (0, 1]"),
        (["--gpu-memory-utilization", "0"], "expected a fraction in (0, 1]"),
        (["--num-gpu-blocks-override", "0"], "--num-gpu-blocks-override: expected a number of at least 1"),
        (["--port", "70000"], "expected a port number from 0 to 65535"),
        (["--port", "http"], "--port: expected a whole number"),
        (["--block-size", "0"], "--block-size: expected a number of at least 1"),
        (["--uvicorn-log-level", "loud"], "invalid choice: 'loud'"),
        (["--enable-prefix-caching=yes"], "ignored explicit argument"),
    ],
)
def test_serve_bad_arguments_give_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *args])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message in lines[0]


def test_serve_is_listed_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "serve" in capsys.readouterr().out


def test_serve_refuses_a_setting_the_engine_refuses_in_one_line(capsys):
    pytest.importorskip("fastapi")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--tiny", "--max-model-len", "1000"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == "python -m paged_kv serve: error: max_model_len 1000 exceeds the model's max_len 256\n"


def test_serve_tiny_hands_the_app_to_uvicorn(monkeypatch, capsys):
    """``paged-kv serve --tiny`` builds the engine and the app, prints where, and runs uvicorn (here
    a stand-in that serves the app in a thread of this process and asks it one question)."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from paged_kv.entrypoints.openai import launcher

    seen = {}

    def serve_http(app, *, host, port, log_level):
        seen.update(host=host, port=port, log_level=log_level)
        with launcher.ServerThread(app) as server:
            seen["models"] = httpx.get(f"{server.url}/v1/models", timeout=30).json()
            seen["async_llm"] = server.async_llm

    monkeypatch.setattr(launcher, "serve_http", serve_http)
    argv = [
        "serve",
        "--tiny",
        "--num-gpu-blocks-override",
        "8",
        "--port",
        "8123",
        "--no-enable-prefix-caching",
    ]
    assert main(argv) == 0
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8123 and seen["log_level"] == "info"
    (card,) = seen["models"]["data"]
    assert card["id"] == "tiny-gpt" and card["max_model_len"] == 256
    cache = seen["async_llm"].vllm_config.cache_config
    assert (cache.num_gpu_blocks, cache.block_size, cache.enable_prefix_caching) == (8, 16, False)
    out = capsys.readouterr().out
    assert "8 blocks of 16 tokens, max_model_len 256, prefix caching off" in out
    assert "serving 'tiny-gpt' at http://127.0.0.1:8123/v1" in out
