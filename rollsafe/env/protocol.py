"""The environment checkpoint protocol, version 1 (docs/design.md section 7): every message.

HTTP + JSON under ``/checkpoint/v1``, bearer token minted per run. One environment *instance*
(a server process) speaks it for all the episodes it runs:

==========================  ======================  ==========================================
endpoint                    body                    reply
==========================  ======================  ==========================================
``GET  status``             —                       :class:`StatusReply`
``POST prepare``            :class:`PrepareRequest`  :class:`PrepareReply`
``POST renew``              :class:`RenewRequest`    :class:`RenewReply`
``POST commit``             :class:`CommitRequest`   :class:`CommitReply`
``POST resume``             :class:`ResumeRequest`   :class:`ResumeReply`
``POST retire``             :class:`RetireRequest`   :class:`CountReply`
``POST forget``             :class:`ForgetRequest`   :class:`CountReply`
``POST restore``            :class:`RestoreRequest`  :class:`RestoreReply`
``POST effects``            :class:`EffectsRequest`  :class:`EffectsReply`
``POST lease``              :class:`RunLease`        :class:`LeaseReply`
``POST /episodes/run``      :class:`RunEpisode`      :class:`EpisodeResult` (or 409)
==========================  ======================  ==========================================

Phases ``idle → prepared → committed → idle`` and ``idle → restored → idle``; ``resume`` ends
any of them (and so is also the abort). A lease expires at ``deadline_ts + lease_grace_s`` and
the instance resumes by itself. Completed operations replay idempotently per
``(checkpoint_id, op)``; a resumed checkpoint id is never accepted again. Errors are
:class:`ErrorReply` with an HTTP status: 401 token, 409 refused in this phase (``error`` names
why: ``checkpoint_parked``, ``retired``, ``checkpoint_resumed``, ``wrong_phase``,
``other_checkpoint``), 422 malformed body (names the field), 503 unavailable.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from rollsafe.core.wire import omit_unused

PROTOCOL_VERSION = 1
PREFIX = "/checkpoint/v1"
EPISODES_RUN = "/episodes/run"

# An instance's place in the checkpoint protocol (not a snapshot's phase: rollsafe.core.phases).
InstancePhase = Literal["idle", "prepared", "committed", "restored"]
ParticipantKind = Literal["environment", "model", "agent", "resources"]
# What an episode was doing when its instance parked.
Activity = Literal["boundary", "generating", "tool"]

ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9._-]{1,64}-(0|[1-9][0-9]*)_g(0|[1-9][0-9]*)$"
CHECKPOINT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_HEX64 = r"^[0-9a-f]{64}$"


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EpisodeRef(_Message):
    """One attempt of one rollout (``rollsafe.core.ids.EpisodeId`` on the wire)."""

    rollout_id: str = Field(pattern=ROLLOUT_ID_PATTERN)
    attempt: int = Field(ge=0)

    @property
    def key(self) -> str:
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"

    def next_attempt(self) -> EpisodeRef:
        return EpisodeRef(rollout_id=self.rollout_id, attempt=self.attempt + 1)


def _unique(refs: tuple[EpisodeRef, ...], what: str) -> None:
    keys = [r.key for r in refs]
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"{what} names episode(s) more than once: {', '.join(twice[:5])}")


class ErrorReply(_Message):
    error: str = Field(description="a class or reason name, e.g. checkpoint_parked")
    detail: str = ""


# -- status -------------------------------------------------------------------------------------


class StatusReply(_Message):
    protocol_version: Literal[1] = 1
    instance: str
    phase: InstancePhase
    checkpoint_id: str | None = Field(
        default=None, description="the open checkpoint (or restore) id; None when idle"
    )
    lease_expires_ts: float | None = None
    live_episodes: int = Field(ge=0)
    retired: int = Field(ge=0, description="episodes refused until forget")
    participants: tuple[str, ...] = Field(description="participant names, in commit order")


# -- prepare / renew ----------------------------------------------------------------------------


class PrepareRequest(_Message):
    checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)
    # Finite: JSON 1e400 parses as inf, and an infinite lease would never run out.
    deadline_ts: float = Field(
        gt=0, allow_inf_nan=False, description="unix time by which parking must be done"
    )


class ParkedEpisode(_Message):
    episode: EpisodeRef
    turn: int = Field(ge=0, description="turns completed")
    activity: Activity
    model_call_id: str | None = Field(
        default=None, description="the policy call still generating when parked (cut target)"
    )


class PrepareReply(_Message):
    ready: bool
    blockers: tuple[str, ...] = ()
    parked: tuple[ParkedEpisode, ...] = ()
    restarts: tuple[EpisodeRef, ...] = Field(
        default=(), description="live episodes that cannot be captured: restart from input"
    )
    lease_expires_ts: float


class RenewRequest(_Message):
    checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)
    deadline_ts: float = Field(gt=0, allow_inf_nan=False)


class RenewReply(_Message):
    lease_expires_ts: float


# -- commit -------------------------------------------------------------------------------------


class CommitRequest(_Message):
    checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)
    scope: tuple[EpisodeRef, ...] = Field(description="the episodes to export; nothing else")
    dest: str = Field(min_length=1, description="directory for this instance's records")

    @model_validator(mode="after")
    def _distinct(self) -> CommitRequest:
        _unique(self.scope, "scope")
        return self


class ParticipantManifest(_Message):
    """What one participant wrote: ``<dest>/<name>/manifest.json`` holds the same fields."""

    schema_version: Literal[1] = 1
    name: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")
    kind: ParticipantKind
    instance: str
    checkpoint_id: str
    file: str = Field(description="records file, relative to dest")
    sha256: str = Field(pattern=_HEX64)
    records: int = Field(ge=0)
    # Whether another instance of the same environment may restore these records (its
    # instance lost for good): EnvironmentHooks.portable. Absent in older manifests: True.
    portable: bool = True

    @model_serializer(mode="wrap")
    def _as_before_when_portable(self, handler: SerializerFunctionWrapHandler) -> Any:
        return omit_unused(handler(self), self, "portable")


class CommitReply(_Message):
    committed: tuple[EpisodeRef, ...]
    participants: tuple[ParticipantManifest, ...]


# -- resume / retire / forget -------------------------------------------------------------------


class ResumeRequest(_Message):
    checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN, description="or a restore id")


class ResumeReply(_Message):
    phase: InstancePhase
    resumed: bool = Field(description="False: it was not open (lease ran out, or never was)")


class RetireRequest(_Message):
    rollouts: tuple[EpisodeRef, ...] = Field(min_length=1)


class ForgetRequest(_Message):
    rollouts: tuple[EpisodeRef, ...] = Field(min_length=1)


class CountReply(_Message):
    count: int = Field(ge=0)


# -- restore ------------------------------------------------------------------------------------


class AdoptedEpisodes(_Message):
    """Episodes another instance committed, restored here because that instance is no longer
    in the fleet (docs/operations.md, "an environment instance lost for good")."""

    instance: str = Field(min_length=1, description="the instance that committed them")
    root: str = Field(min_length=1, description="the directory that instance's commit wrote")
    scope: tuple[EpisodeRef, ...] = Field(min_length=1, description="as committed (attempt n)")


class RestoreRequest(_Message):
    restore_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)
    source_checkpoint_id: str = Field(pattern=CHECKPOINT_ID_PATTERN)
    root: str = Field(min_length=1, description="the directory commit wrote (its dest)")
    scope: tuple[EpisodeRef, ...] = Field(description="episodes as committed (attempt n)")
    adopted: tuple[AdoptedEpisodes, ...] = Field(
        default=(), description="episodes of lost instances this one restores too"
    )
    prefixes: dict[str, Any] = Field(
        default_factory=dict,
        description="model call id -> staged PrefixRecord (JSON), for calls cut while parked",
    )
    deadline_ts: float = Field(gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _distinct(self) -> RestoreRequest:
        _unique(self.episodes, "scope and adopted")
        return self

    @model_serializer(mode="wrap")
    def _as_before_without_adoptions(self, handler: SerializerFunctionWrapHandler) -> Any:
        return omit_unused(handler(self), self, "adopted")

    @property
    def episodes(self) -> tuple[EpisodeRef, ...]:
        """Every episode this request restores: its own scope, then the adopted ones."""
        return (*self.scope, *(ep for adopted in self.adopted for ep in adopted.scope))


class RestoreReply(_Message):
    restored: tuple[EpisodeRef, ...] = Field(description="each as attempt n + 1")
    lease_expires_ts: float


# -- episodes -----------------------------------------------------------------------------------


HOLDER_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
MAX_RUN_LEASE_S = 300.0


class RunLease(_Message):
    """A dispatcher's lease on its episodes: while it holds (renewed within ``ttl_s``), the
    episodes it dispatched under ``holder`` make effects; once it runs out (the dispatcher is
    gone), they are refused before their next effect or boundary (409 ``lease_expired``).
    ``ttl_s`` runs on the instance's own clock from the moment the request arrives."""

    holder: str = Field(pattern=HOLDER_PATTERN)
    ttl_s: float = Field(gt=0, le=MAX_RUN_LEASE_S)


class LeaseReply(_Message):
    holder: str
    expires_ts: float = Field(description="the instance's clock")


class RunEpisode(_Message):
    """Drive one episode to its end. A restored episode is continued when its attempt is the
    restored attempt (n + 1); otherwise the episode starts from ``task``."""

    episode: EpisodeRef
    task: dict[str, Any] = Field(default_factory=dict, description="environment-specific")
    audit: bool = Field(
        default=False,
        description="reply with the run's EpisodeAudit (env-check compares attempts with it)",
    )
    lease: RunLease | None = Field(
        default=None,
        description="the dispatcher's run lease, taken (renewed) as the run is admitted; "
        "None: the run is fenced by nothing but its successors",
    )

    @model_serializer(mode="wrap")
    def _as_before_without_audit(self, handler: SerializerFunctionWrapHandler) -> Any:
        return omit_unused(handler(self), self, "audit", "lease")


EFFECT_NAME_PATTERN = r"^[A-Za-z0-9._:@-]{1,128}$"


class AppliedEffect(_Message):
    """One effect applied on an instance (rollsafe.env.effects): in a commit's records and in
    the ``effects`` reply."""

    turn: int = Field(ge=0)
    name: str = Field(pattern=EFFECT_NAME_PATTERN)
    args_sha256: str = Field(pattern=_HEX64)
    result: Any = Field(description="what the effect returned (JSON); a later call gets it")
    attempt: int = Field(ge=0, description="the attempt that applied it")
    applied_ts: float = Field(description="when its apply began, on the instance's clock")


class EffectUse(_Message):
    """An effect a run asked for: applied by it, or answered from the ledger."""

    turn: int = Field(ge=0)
    name: str
    applied: bool = Field(description="False: applied before (any attempt), answered here")


class CallRecord(_Message):
    """A model call a run made through ``session.complete``: one part of the training row."""

    call_id: str
    boundary: int = Field(ge=0, description="turns completed when the call was made")
    prompt_sha256: str
    tokens: tuple[int, ...] = Field(description="the generated tokens, a resumed prefix's too")


class EpisodeAudit(_Message):
    """What a run did besides its result, when :attr:`RunEpisode.audit` asked for it."""

    effects: tuple[EffectUse, ...] = ()
    calls: tuple[CallRecord, ...] = ()
    generating: int = Field(
        default=0,
        ge=0,
        description="model calls waited on inside session.generating, session.complete's "
        "included: more than len(calls) means calls whose tokens the audit cannot see",
    )
    state_digests: dict[int, str] = Field(
        default_factory=dict,
        description="boundary turn -> the environment's state_digest there (empty: no hook)",
    )
    side_effects: bool = Field(
        default=True, description="False: the environment declares it makes none"
    )
    attempt_info: tuple[str, ...] = Field(
        default=(), description="paths in info the environment declares describe the attempt"
    )

    @model_serializer(mode="wrap")
    def _as_before_without_declarations(self, handler: SerializerFunctionWrapHandler) -> Any:
        return omit_unused(handler(self), self, "side_effects", "attempt_info")


class EffectsRequest(_Message):
    rollouts: tuple[str, ...] = Field(min_length=1, max_length=1000)


class RolloutEffects(_Message):
    rollout_id: str
    current_attempt: int | None = Field(
        description="the attempt last run or restored there (None: none known)"
    )
    live_attempts: tuple[int, ...] = Field(description="its attempts running there now")
    applied: tuple[AppliedEffect, ...]


class EffectsReply(_Message):
    rollouts: tuple[RolloutEffects, ...]
    leases: dict[str, float] = Field(
        default_factory=dict, description="each run lease's holder -> when it runs out"
    )


class EpisodeResult(_Message):
    episode: EpisodeRef
    reward: float
    turns: int = Field(ge=0)
    restored: bool = Field(description="continued from a restored checkpoint")
    restored_at_turn: int | None = Field(
        default=None,
        ge=0,
        description="a restored attempt: the first turn boundary it reached, i.e. where it "
        "continued its record (the parked turn, or the next one if a call was in flight)",
    )
    prefix_tokens: int = Field(
        default=0,
        ge=0,
        description="tokens this run's model calls took from the staged prefixes of calls a "
        "checkpoint cut, instead of generating them again",
    )
    info: dict[str, Any] = Field(default_factory=dict, description="environment-specific")
    audit: EpisodeAudit | None = Field(default=None, description="asked for: RunEpisode.audit")

    @model_serializer(mode="wrap")
    def _as_before_without_audit(self, handler: SerializerFunctionWrapHandler) -> Any:
        return omit_unused(handler(self), self, "audit")
