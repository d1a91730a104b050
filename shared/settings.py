"""Settings for every Gyre process: `GYRE_…` environment variables over an optional TOML/YAML config file.

Precedence (highest first): explicit overrides, environment, the config file named by `GYRE_CONFIG`, defaults.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BeforeValidator, Field
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict


def split_names(value: Any) -> Any:
    """Comma-separated names (`a, b`) or a JSON list as a list of names; anything else as it is."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        return json.loads(text)
    return [t.strip() for t in text.split(",") if t.strip()]


# A list setting whose `GYRE_…` variable is comma-separated names (`a,b`) or a JSON list.
NameList = Annotated[list[str], NoDecode, BeforeValidator(split_names)]


class SettingsError(Exception):
    pass


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GYRE_", extra="ignore", frozen=True)

    # Infrastructure. Empty URLs mean "start embedded servers under state_dir" (see gyre.local).
    database_url: str = ""
    nats_url: str = ""
    state_dir: Path = Path(".gyre")
    subject_prefix: str = "gyre"
    db_schema: str | None = None

    # Identity of this process in logs and events.
    run_id: str = "local"
    node_id: str = Field(default_factory=lambda: os.uname().nodename)

    # Bus behaviour.
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    backoff_s: list[float] = Field(default_factory=lambda: [0.5, 2.0, 5.0])
    duplicate_window_s: float = 120.0
    # Copies JetStream keeps of each stream and Object Store bucket a process creates: 1 on one server, 3 on a
    # three-server cluster (a server lost loses nothing).
    stream_replicas: int = Field(default=1, ge=1, le=5)
    # How long a service's own writes (not a delivery's, which is redelivered) wait out a store they cannot reach.
    store_outage_s: float = 300.0

    # RL shape (SPEC §5–§7).
    group_size: int = 16
    queries_per_step: int = 1
    cap_k: int = 8
    max_staleness: int = 1
    micro_batch_tokens: int = 4096
    drop_zero_variance: bool = True
    advantage_eps: float = 1e-6

    # Loss (SPEC §6).
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    is_cap: float = 2.0
    recompute_old_logprobs: bool = False

    # Models and health.
    model_dir: Path | None = None
    health_port: int = 0
    # Where the health and /metrics endpoint listens: loopback by default; 0.0.0.0 where an orchestrator or a
    # Prometheus on another host scrapes it (compose, Kubernetes).
    health_host: str = "127.0.0.1"
    mode: Literal["elastic", "async", "colocate", "reprefill"] = "async"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _ConfigFileSource(settings_cls))


class _ConfigFileSource(PydanticBaseSettingsSource):
    """Reads the YAML (or JSON) file named by GYRE_CONFIG; keys are the field names without the prefix."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        path = os.environ.get("GYRE_CONFIG")
        self._values: dict[str, Any] = {}
        if path:
            file = Path(path)
            if not file.is_file():
                raise SettingsError(f"GYRE_CONFIG names {file}, which is not a file")
            loaded = yaml.safe_load(file.read_text()) or {}
            if not isinstance(loaded, dict):
                raise SettingsError(f"{file}: expected a mapping of settings, got {type(loaded).__name__}")
            unknown = sorted(set(loaded) - set(settings_cls.model_fields))
            if unknown:
                raise SettingsError(f"{file}: unknown settings {unknown}")
            self._values = loaded

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._values)


def load_settings(**overrides: Any) -> Settings:
    return Settings(**overrides)


def new_run_id() -> str:
    return "run-" + uuid.uuid4().hex[:12]
