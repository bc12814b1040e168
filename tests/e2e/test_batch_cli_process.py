"""The batch CLI (`python -m gateway.batch.cli`) as a real process, against a cluster with a batch worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.batch_cluster import batch_fixture, chat_line, jsonl
from tests.support.cluster import Cluster

cluster = batch_fixture("tiny_model_path")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Runs the CLI with its arguments and captures what it prints."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "gateway.batch.cli", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_submit_waits_writes_the_files_and_reports_progress(cluster: Cluster, tmp_path: Path) -> None:
    lines = [chat_line(f"req-{i}", f"Count to {i}.") for i in range(19)]
    path = tmp_path / "requests.jsonl"
    path.write_bytes(jsonl([*lines[:7], "{not json", *lines[7:]]))
    done = cli("submit", str(path), "--wait", "--url", cluster.base_url, "--poll-s", "0.2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.strip()
    assert batch_id.startswith("batch_") and done.stdout == f"{batch_id}\n"
    outputs = [json.loads(line) for line in (tmp_path / "requests.output.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in range(19)]
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    assert len((tmp_path / "requests.errors.jsonl").read_text().splitlines()) == 1
    progress = done.stderr.splitlines()
    assert any("20/20 done (19 ok, 1 failed) completed" in line for line in progress), done.stderr
    assert "\r" not in done.stderr  # not a terminal: one line per change

    shown = cli("status", batch_id, "--url", cluster.base_url, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    batch = json.loads(shown.stdout)
    assert batch["id"] == batch_id and batch["status"] == "completed"

    again = cli("results", batch_id, "--url", cluster.base_url, "--output", "out.jsonl", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "out.jsonl").read_bytes() == (tmp_path / "requests.output.jsonl").read_bytes()
    assert (tmp_path / f"{batch_id}.errors.jsonl").exists()

    ended = cli("cancel", batch_id, "--url", cluster.base_url, cwd=tmp_path)
    assert ended.returncode == 2 and ended.stderr.startswith("error: ") and "ended" in ended.stderr


def test_results_of_an_unknown_batch_is_an_error(cluster: Cluster, tmp_path: Path) -> None:
    done = cli("results", "batch_nope", "--url", cluster.base_url, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "batch_nope" in done.stderr
    assert not list(tmp_path.iterdir())


def test_submit_of_a_missing_file_is_an_error(tmp_path: Path) -> None:
    done = cli("submit", str(tmp_path / "missing.jsonl"), "--wait", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "missing.jsonl" in done.stderr
