"""The gateway's configuration: one dataclass per YAML section, validated like every recipe section.

The variants given here are only the *initial* routing: once the gateway has run, its persisted routing
state (``state_dir/routing.json``, changed through the admin API) wins, so a restart restores what the
rollout controller last set rather than what the file said at first boot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from artifacts.errors import ConfigError

VARIANTS = ("champion", "canary", "shadow", "baseline")


@dataclass
class VariantConfig:
    """A named pool of OpenAI-compatible replicas serving one snapshot."""

    replicas: list[str] = field(default_factory=list)
    version: str = ""  # the registry version it serves (labels metrics and records)
    served_model: str = ""  # the `model` the replicas expect; "" keeps the client's

    def __post_init__(self) -> None:
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replicas: {url!r} is not an http(s) URL")
        self.replicas = [url.rstrip("/") for url in self.replicas]


@dataclass
class AdapterConfig:
    """An adapter served on the champion's replicas under its own public name (an adapter lane): the name the
    replicas load it under and the registry version it is. Its rollouts move the lane, not these lines."""

    served_model: str
    version: str = ""

    def __post_init__(self) -> None:
        if not self.served_model:
            raise ValueError("served_model: the name the replicas serve the adapter under is required")


@dataclass
class ShadowConfig:
    """Mirroring budget: a mirror may never slow or starve the user's request."""

    fraction: float = 0.0  # share of champion requests mirrored to the shadow variant
    max_concurrency: int = 4  # mirrors in flight at once; more are dropped (and counted)
    max_tokens_in_flight: int = 8192  # estimated prompt + max_tokens of mirrors in flight
    store_text_chars: int = 2000  # each stored pair keeps at most this much of either reply

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction: must be in [0, 1], got {self.fraction}")
        if self.max_concurrency < 0 or self.max_tokens_in_flight < 0:
            raise ValueError("max_concurrency and max_tokens_in_flight must be >= 0")


@dataclass
class HealthConfig:
    interval_s: float = 1.0  # how often each replica's /ready is polled
    timeout_s: float = 2.0
    eject_after: int = 2  # consecutive failures (polls or requests) before a replica takes no traffic

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.eject_after < 1:
            raise ValueError("interval_s and timeout_s must be > 0, eject_after >= 1")


@dataclass
class LimitsConfig:
    """Per-key defaults; a key in the keys file may carry its own."""

    requests_per_minute: float = 600.0
    tokens_per_minute: float = 200_000.0
    default_max_tokens: int = 256  # what a chat request without max_tokens reserves against the budget

    def __post_init__(self) -> None:
        if self.requests_per_minute <= 0 or self.tokens_per_minute <= 0 or self.default_max_tokens < 1:
            raise ValueError("requests_per_minute, tokens_per_minute and default_max_tokens must be > 0")


@dataclass
class AccessLogConfig:
    """One line per request, in ``state_dir/access.log``, rotated: never on the terminal, never unbounded."""

    enabled: bool = True  # false: per-request lines are dropped
    max_bytes: int = 10_000_000  # a file rotates before it would grow past this
    backups: int = 3  # rotated files kept (access.log.1 ...); at most backups + 1 files in all

    def __post_init__(self) -> None:
        if self.max_bytes < 1024 or self.backups < 1:
            raise ValueError(f"max_bytes must be >= 1024 and backups >= 1, got {self.max_bytes} and {self.backups}")


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    model_name: str = ""  # the model id clients send; "" means the champion's served model name
    state_dir: str = ".lifecycle/gateway"  # routing.json (persisted routing) and observations.db
    keys_file: Optional[str] = None  # hashed API keys; without one the gateway is open and has no admin API
    tokenizer_file: Optional[str] = None  # a tokenizer.json: shadow divergence counted in model tokens
    champion: VariantConfig = field(default_factory=VariantConfig)
    canary: VariantConfig = field(default_factory=VariantConfig)
    shadow: VariantConfig = field(default_factory=VariantConfig)
    baseline: VariantConfig = field(default_factory=VariantConfig)  # the champion's snapshot, the canary's share
    canary_weight: float = 0.0  # percent of conversations on the canary
    adapters: dict[str, AdapterConfig] = field(default_factory=dict)  # public adapter name → what serves it
    shadow_mirror: ShadowConfig = field(default_factory=ShadowConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    access_log: AccessLogConfig = field(default_factory=AccessLogConfig)
    # ask replicas for token ids on streams (vLLM's return_token_ids; ours has it) so a stream whose replica dies
    # is finished from exactly its tokens; false for replicas that refuse unknown fields (then: from its text)
    stream_token_ids: bool = True
    connect_timeout_s: float = 2.0
    upstream_timeout_s: float = 600.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port: must be in 1..65535, got {self.port}")
        if not 0.0 <= self.canary_weight <= 100.0:
            raise ValueError(f"canary_weight: must be in [0, 100], got {self.canary_weight}")
        if self.connect_timeout_s <= 0 or self.upstream_timeout_s <= 0:
            raise ValueError("connect_timeout_s and upstream_timeout_s must be > 0")

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).expanduser()


def load_gateway_config(path: str | Path) -> GatewayConfig:
    """Read and validate a gateway YAML; relative paths inside it are relative to the file."""
    from artifacts.common.config_loader import build_dataclass, read_yaml_mapping

    path = Path(path)
    config = build_dataclass(GatewayConfig, read_yaml_mapping(path), key="", source=path)
    config.state_dir = _resolve(path.parent, config.state_dir) or config.state_dir
    config.keys_file = _resolve(path.parent, config.keys_file)
    config.tokenizer_file = _resolve(path.parent, config.tokenizer_file)
    return config


def _resolve(base: Path, value: str | None) -> str | None:
    if value is None:
        return None
    candidate = Path(value).expanduser()
    return str(candidate if candidate.is_absolute() else (base / candidate).resolve())


__all__ = ["VARIANTS", "AccessLogConfig", "AdapterConfig", "ConfigError", "GatewayConfig", "HealthConfig",
           "LimitsConfig", "ShadowConfig", "VariantConfig", "load_gateway_config"]
