"""Settings keep one name everywhere: the settings classes, --help, the README and docker-compose.yml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared.settings import CommonSettings, GatewaySettings, SchedulerSettings, WorkerSettings, parse_settings

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"gateway": GatewaySettings, "scheduler_svc": SchedulerSettings, "gpu_worker": WorkerSettings}


def env_names(cls: type[CommonSettings]) -> set[str]:
    return {name.upper() for name in cls.model_fields}


def test_readme_lists_every_setting() -> None:
    readme = (ROOT / "README.md").read_text()
    for cls in SERVICES.values():
        for name in env_names(cls):
            assert f"`{name}`" in readme, name


def test_compose_uses_only_known_settings() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = {"gateway": GatewaySettings, "scheduler": SchedulerSettings, "worker": WorkerSettings}
    for service, cls in services.items():
        environment = compose["services"][service]["environment"]
        unknown = set(environment) - env_names(cls)
        assert not unknown, f"{service}: {unknown}"


@pytest.mark.parametrize("module", sorted(SERVICES))
def test_help_lists_every_variable(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    flat = " ".join(out.split())  # argparse wraps long help lines
    for name in env_names(SERVICES[module]):
        assert f"[env {name}," in flat, name


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PORT", "9001")
    monkeypatch.setenv("MAX_NUM_SEQS", "7")
    assert parse_settings(GatewaySettings, []).port == 9001
    assert parse_settings(GatewaySettings, ["--port", "9002"]).port == 9002
    assert parse_settings(WorkerSettings, []).max_num_seqs == 7
    with pytest.raises(ValueError):
        parse_settings(WorkerSettings, ["--block-size", "many"])
