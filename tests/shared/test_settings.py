"""Settings keep one name everywhere: the settings classes, --help, the manual's settings table
(docs/deployment.md) and docker-compose.yml."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from gateway.batch.settings import BatchSettings
from gateway.settings import GatewaySettings
from gpu_worker.engine.config import EngineConfig
from gpu_worker.settings import WorkerSettings, engine_config
from scheduler_svc.settings import SchedulerSettings
from shared.settings import CommonSettings, parse_settings
from tests.support import REPO

SERVICES = {
    "gateway": GatewaySettings,
    "gateway.batch": BatchSettings,
    "scheduler_svc": SchedulerSettings,
    "gpu_worker": WorkerSettings,
}
COMPOSE_SERVICES = {
    "gateway": GatewaySettings,
    "batch": BatchSettings,
    "scheduler": SchedulerSettings,
    "worker": WorkerSettings,
}


def env_names(cls: type[CommonSettings]) -> set[str]:
    return {name.upper() for name in cls.model_fields}


def docs_row(name: str) -> str:
    """The manual's settings-table row for a field: the services that read it, its default, its meaning."""
    owners = [service for service, cls in COMPOSE_SERVICES.items() if name in cls.model_fields]
    field = COMPOSE_SERVICES[owners[0]].model_fields[name]
    if field.default_factory is not None:
        default = "`host-pid`"  # the worker id: computed per process
    elif field.default is None:
        default = ""
    else:
        default = f"`{field.default if field.default != '' else '(none)'}`"
    services = "all" if len(owners) == len(COMPOSE_SERVICES) else ", ".join(owners)
    return f"| `{name.upper()}` | {services} | {default} | {field.description} |".replace("|  |", "| |")


def test_the_manual_states_every_setting_as_the_code_does() -> None:
    table = (REPO / "docs" / "deployment.md").read_text().splitlines()
    rows = {line for line in table if line.startswith("| `")}
    names = {name for cls in SERVICES.values() for name in cls.model_fields}
    for name in names:
        assert docs_row(name) in rows, docs_row(name)


def test_compose_restarts_every_service() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert {name: s.get("restart") for name, s in compose["services"].items()} == dict.fromkeys(
        ["redis", *COMPOSE_SERVICES, "worker-second"], "unless-stopped"
    )


def test_compose_uses_only_known_settings() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for service, cls in [*COMPOSE_SERVICES.items(), ("worker-second", WorkerSettings)]:
        environment = compose["services"][service]["environment"]
        unknown = set(environment) - env_names(cls)
        assert not unknown, f"{service}: {unknown}"


@pytest.mark.parametrize("module", sorted(SERVICES))
def test_help_lists_every_variable(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True, cwd=REPO
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


def test_the_engine_config_comes_from_the_worker_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine option is a worker setting of the same name, read from the environment."""
    values = {
        "block_size": 8,
        "num_kv_blocks": 9,
        "kv_cache_memory_bytes": 4096,
        "gpu_memory_utilization": 0.5,
        "max_num_seqs": 3,
        "max_num_batched_tokens": 64,
        "max_model_len": 100,
        "enable_prefix_caching": False,
        "seed": 42,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
        "model_impl": "transformers",
    }
    assert set(values) == set(EngineConfig.model_fields)
    for name, value in values.items():
        monkeypatch.setenv(name.upper(), json.dumps(value) if isinstance(value, dict) else str(value))
    assert engine_config(parse_settings(WorkerSettings, [])) == EngineConfig(**values)
    assert engine_config(parse_settings(WorkerSettings, ["--seed", "5"])).seed == 5
    with pytest.raises(ValueError, match="block_size"):
        parse_settings(WorkerSettings, ["--block-size", "12"])
