"""What an agent advertises in the registry bucket."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from mlscope.contracts._base import Ident, _Message


class Accelerator(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["gpu", "fpga", "npu"]
    model: str
    index: int = 0
    memory_bytes: int | None = None
    interconnect: str | None = None
    """How the device is attached, as the driver reports it (``pcie4``, ``nvlink``);
    None when it does not say."""


class FrameworkInfo(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    version: str
    devices: tuple[str, ...] = ("cpu",)


class ModelOffer(BaseModel):
    """A model an agent can serve, with the artifact it would load."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    version: str
    framework: str
    sha256: str | None = None


RefusalReason = Literal[
    "missing", "checksum", "custom_code", "framework_version", "policy", "invalid"
]


class RefusedModel(BaseModel):
    """A model of the agent's framework that it does not serve, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    version: str
    framework: str
    reason: RefusalReason
    """missing: not built / not present; checksum: the file differs from its build lock
    or pin; custom_code: a step this agent may not run; framework_version: the
    manifest's constraint excludes this agent's runtime; policy: a manifest from the bus
    names an asset location the fetch policy refuses (mlscope.fetchpolicy); invalid:
    anything else."""
    message: str
    fix: str | None = None
    """The command that mends it, when there is one."""


MAX_REFUSALS = 32
"""Most refusals an agent's entry lists; the rest are only counted
(``AgentDescription.refused_more``). Every manifest of the agent's framework on the
bus that it cannot serve is one refusal, and the entry must fit one message."""
REFUSAL_MESSAGE_MAX_CHARS = 400
"""Longest refusal message an agent's entry carries (writers cut longer ones)."""

EPOCH_LIMIT_S = 4.1e9
"""The latest wall-clock time (s since the epoch, year 2099) a registry entry may carry."""


class AgentDescription(_Message):
    """What an agent puts in the registry bucket under its id (refreshed by heartbeat)."""

    kind: Literal["agent"] = "agent"
    agent_id: Ident
    host: str
    arch: str
    os: str
    cpu_model: str
    cpu_cores: int
    memory_bytes: int
    usable_cores: int | None = Field(default=None, ge=1)
    """Cores this agent may run on (its CPU affinity); ``cpu_cores`` is the machine's."""
    memory_limit_bytes: int | None = Field(default=None, ge=0)
    """The agent's memory limit (its cgroup's) when lower than ``memory_bytes``."""
    accelerators: tuple[Accelerator, ...] = ()
    frameworks: tuple[FrameworkInfo, ...]
    models: tuple[ModelOffer, ...] = ()
    refused: tuple[RefusedModel, ...] = Field(default=(), max_length=MAX_REFUSALS)
    """Models of this framework that the agent does not serve, with the reason (the
    first :data:`MAX_REFUSALS` of them, each message at most
    :data:`REFUSAL_MESSAGE_MAX_CHARS` long)."""
    refused_more: int = Field(default=0, ge=0)
    """Refused models left out of ``refused`` (over :data:`MAX_REFUSALS`, or dropped so
    that the entry fits the bus's max payload)."""
    capabilities: tuple[str, ...] = ()
    pid: int = Field(ge=1, lt=1 << 32)
    mlscope_version: str
    started_at: float = Field(ge=0, le=EPOCH_LIMIT_S, allow_inf_nan=False)
    heartbeat_at: float = Field(ge=0, le=EPOCH_LIMIT_S, allow_inf_nan=False)
    heartbeat_s: float = Field(gt=0, le=3600, allow_inf_nan=False)
    features: tuple[str, ...] = ()
    """Optional abilities of this agent, e.g. :data:`LOCAL_RUN` (an agent that does
    not list one is refused jobs that need it)."""
