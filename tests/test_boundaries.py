"""The boundaries between folders: each is one process or one library, and imports only what RULES allow.

- shared/ (library: protocol, keys, settings) imports no other package of the project, and no torch.
- kernels/ (library: the paged-attention ops and their twins) imports no service and no redis.
- gpu_worker/engine/ (library: the paged engine) imports no redis and nothing of the worker service.
- gpu_worker/ (process: the worker service) imports nothing of the gateway or the scheduler.
- gateway/serving/ (library: the request layer) imports no Flask, no HTTP module of the gateway, no batch
  worker, no torch; gateway/batch/ (process: the batch worker) the same, but for the request layer.
- gateway/ (process: the HTTP gateway) and scheduler_svc/ (process) import no engine and no torch.

Each rule is checked on the source (every import, at a file's top or inside a function) and, for the rules
that must also hold for what those imports import in turn, in a fresh interpreter. The end-to-end cluster
(test_e2e.py) runs the gateway and the scheduler under `without_engine` and checks that no torch library is
mapped into their processes.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from shared.model_files import default_model_path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_MODULES = {"torch", "gpu_worker", "kernels"}
HTTP_STACK = ("flask", "werkzeug", "gunicorn", "prometheus_client")


def modules_in(folder: str) -> tuple[str, ...]:
    """The modules of a folder itself (not of the folders in it)."""
    package = folder.replace("/", ".")
    return tuple(f"{package}.{path.stem}" for path in (ROOT / folder).glob("*.py") if path.stem != "__init__")


HTTP_PROCESS = modules_in("gateway")
WORKER_SERVICE = modules_in("gpu_worker")
SERVICES = ("gateway", "scheduler_svc", "gpu_worker")
# What each folder's files never import (module names, or the packages they start): folder -> forbidden.
RULES: dict[str, tuple[str, ...]] = {
    "shared": (*SERVICES, "kernels", "torch"),
    "kernels": (*SERVICES, "redis"),
    "gpu_worker/engine": (
        "redis",
        "gpu_worker.service",
        "gpu_worker.assignments",
        "gpu_worker.request_table",
        "gpu_worker.outbox",
        "gpu_worker.settings",
        "gpu_worker.simulation",
        "gateway",
        "scheduler_svc",
    ),
    "gpu_worker": ("gateway", "scheduler_svc"),
    "gateway/serving": (*HTTP_STACK, *HTTP_PROCESS, "gateway.batch", *ENGINE_MODULES),
    "gateway/batch": (*HTTP_STACK, *HTTP_PROCESS, *ENGINE_MODULES),
    "gateway": ("gateway.batch", *ENGINE_MODULES),
    "scheduler_svc": ("gateway", *ENGINE_MODULES),
}


# Rules that hold for everything a library's modules import in turn, checked by importing them all in one
# fresh interpreter (whatever one of them loads shows in the union): name -> (modules, never loaded, torch
# hidden).


def _modules_below(folder: str) -> tuple[str, ...]:
    return tuple(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.stem not in ("__init__", "__main__")
    )


TRANSITIVE: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]] = {
    "the engine": (_modules_below("gpu_worker/engine"), ("redis", "flask", "celery"), False),
    # With torch hidden, as in the gateway's image: importing one that needs it fails the check too.
    "the request layer and the batch worker": (
        _modules_below("gateway/serving") + _modules_below("gateway/batch"),
        HTTP_STACK,
        True,
    ),
}
# What the service image holds (docker/Dockerfile, target `service`).
SERVICE_IMAGE_FILES = ("pyproject.toml", "README.md", "shared", "gateway", "scheduler_svc")


def imported_modules(path: Path) -> set[str]:
    """The full name of every module a file imports, at its top or inside a function (`from a.b import c`
    names a.b and a.b.c: c may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def files_of(folder: str) -> list[Path]:
    """The folder's Python files, without those of a nested folder that has rules of its own."""
    nested = [ROOT / other for other in RULES if other.startswith(folder + "/")]
    return sorted(
        path
        for path in (ROOT / folder).rglob("*.py")
        if not any(path.is_relative_to(inner) for inner in nested)
    )


def forbidden(name: str, rule: tuple[str, ...]) -> bool:
    return any(name == banned or name.startswith(banned + ".") for banned in rule)


@pytest.mark.parametrize("folder", sorted(RULES))
def test_a_folder_imports_only_what_its_rules_allow(folder: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(found)
        for path in files_of(folder)
        if (found := {name for name in imported_modules(path) if forbidden(name, RULES[folder])})
    }
    assert not offenders


def test_the_rules_cover_every_package_of_the_project() -> None:
    packages = {p.parent.relative_to(ROOT).as_posix() for p in ROOT.glob("*/**/__init__.py")}
    packages = {p for p in packages if not p.startswith((".", "tests", "benchmarks"))}
    assert packages - set(RULES) <= {"kernels/csrc"}, packages - set(RULES)


def test_the_boundary_check_finds_an_import_inside_a_function(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from flask import request\n    import torch.nn\n")
    found = imported_modules(source)
    assert {"flask", "flask.request", "torch.nn"} <= found
    assert forbidden("flask.request", RULES["gateway/serving"]) and forbidden("torch.nn", RULES["shared"])
    assert not forbidden("gateway.serving.prepare", RULES["gateway/batch"])


def test_no_test_module_imports_another() -> None:
    """Tests share code through tests/support/ and fixtures through conftest.py files, never by importing a
    test module (or anything of tests/ by a bare name, as pytest's rootdir on sys.path would allow)."""
    own = {p.stem for p in (ROOT / "tests").rglob("*.py")}
    offenders = {
        str(path.relative_to(ROOT)): sorted(found)
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if (
            found := {
                name
                for name in imported_modules(path)
                if (name.startswith("tests.") and not name.startswith("tests.support"))
                or name.partition(".")[0] in own
            }
        )
    }
    assert not offenders


@pytest.mark.parametrize("name", sorted(TRANSITIVE))
def test_what_a_library_imports_in_turn_stays_within_its_rules(
    name: str, without_engine: dict[str, str]
) -> None:
    modules, banned, hide_engine = TRANSITIVE[name]
    probe = (
        f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; "
        f"print(sorted({{m.partition('.')[0] for m in sys.modules}} & set({banned!r})))"
    )
    result = run([sys.executable, "-c", probe], without_engine if hide_engine else None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.replace("'", '"')) == []


def run(
    args: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, env={**os.environ, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("module", sorted(ENGINE_MODULES))
def test_the_blocker_hides_the_engine_as_if_not_installed(
    module: str, without_engine: dict[str, str]
) -> None:
    """The environment the gateway and the scheduler run under in the tests: a test that relies on it fails
    if it stops working."""
    probe = f"import importlib.util; assert importlib.util.find_spec({module!r}) is None; import {module}"
    result = run([sys.executable, "-c", probe], without_engine)
    assert result.returncode == 1 and "ModuleNotFoundError" in result.stderr, result.stderr
    assert run([sys.executable, "-c", f"import {module}"]).returncode == 0  # and only there


@pytest.mark.slow
def test_a_gguf_tokenizer_is_read_without_torch_as_transformers_reads_it(
    without_engine: dict[str, str], smollm2_path: str, tmp_path: Path
) -> None:
    gguf = Path(default_model_path())
    cache = {"PAGEDSERVE_CACHE": str(tmp_path / "cache")}
    result = run([sys.executable, "-m", "shared.model_files", str(gguf)], {**without_engine, **cache})
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert folder.parent == tmp_path / "cache"
    ours = AutoTokenizer.from_pretrained(folder)
    theirs = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name
    )  # transformers' reader needs torch
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert ours.chat_template == theirs.chat_template
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        theirs.bos_token,
        theirs.eos_token,
        theirs.pad_token,
    )
    chat = [{"role": "user", "content": "What is the capital of France? Ça va, 日本?"}]
    assert (
        ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )
    config = json.loads((folder / "config.json").read_text())
    model_config = AutoConfig.from_pretrained(smollm2_path)
    assert config["max_position_embeddings"] == model_config.max_position_embeddings
    assert config["vocab_size"] == model_config.vocab_size
    # Once extracted, it is reused.
    again = run([sys.executable, "-m", "shared.model_files", str(gguf)], {**without_engine, **cache})
    assert again.stdout == result.stdout


def dockerfile_stages() -> dict[str, list[str]]:
    """docker/Dockerfile's stages by name: their instructions, one line each (continuations joined)."""
    text = (ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("FROM "):
            current = stages.setdefault(line.split()[-1], [])
        if line and not line.startswith("#"):
            current.append(line)
    return stages


def test_the_service_image_carries_no_engine() -> None:
    stages = dockerfile_stages()
    service = stages["service"]
    # What it is made of: the Python base, the service's venv and the service's code, nothing else.
    assert service[0].split()[1] == "python"
    sources = {line.split()[1].removeprefix("--from=") for line in service if line.startswith("COPY ")}
    assert sources == {"service-build", "service-code"}
    assert not [
        line for stage in ("service", "service-build") for line in stages[stage] if "torch" in line.lower()
    ]
    code = stages["service-code"]
    copied = {name for line in code if line.startswith("COPY ") for name in line.split()[1:-1]}
    assert copied == set(SERVICE_IMAGE_FILES)
    assert any("'.[gateway,batch,scheduler]'" in line for line in stages["service-build"])


@pytest.mark.venv
@pytest.mark.parametrize(("extra", "module"), [("gateway", "gateway"), ("scheduler", "scheduler_svc")])
def test_a_service_installs_from_its_extra_without_torch(extra: str, module: str, tmp_path: Path) -> None:
    """A fresh venv with only the service's extra, from what its image holds: no torch, and it starts."""
    source = tmp_path / "source"
    source.mkdir()
    for name in SERVICE_IMAGE_FILES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    python = str(venv / "bin" / "python")
    installed = run([python, "-m", "pip", "install", "-q", f"{source}[{extra}]"], cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert (
        run([python, "-c", "import importlib.util as u; assert u.find_spec('torch') is None"]).returncode == 0
    )
    helped = run([python, "-m", module, "--help"], cwd=tmp_path)  # the installed package, not the checkout
    assert helped.returncode == 0 and "[env REDIS_URL," in " ".join(helped.stdout.split()), helped.stderr
    if extra == "gateway":  # every module of the request layer, the app and the batch worker imports
        imported = run(
            [python, "-c", "import gateway.app, gateway.batch.worker, gateway.serving.prepare"], cwd=tmp_path
        )
        assert imported.returncode == 0, imported.stderr[-3000:]
    if extra == "gateway":  # and it reads the default model's tokenizer from its GGUF file
        cache = {"PAGEDSERVE_CACHE": str(tmp_path / "cache")}
        folder = run([python, "-m", "shared.model_files", default_model_path()], cache, cwd=tmp_path)
        assert folder.returncode == 0, folder.stderr[-3000:]
        tokenizer_folder = folder.stdout.strip()
        probe = (
            "import sys; from gateway.serving.tokenization import Tokenizer; "
            "print(Tokenizer(sys.argv[1]).encode('Paris'))"
        )
        encoded = run([python, "-c", probe, tokenizer_folder], cwd=tmp_path)
        assert encoded.returncode == 0, encoded.stderr[-3000:]
        expected = AutoTokenizer.from_pretrained(tokenizer_folder).encode("Paris", add_special_tokens=False)
        assert json.loads(encoded.stdout) == expected
