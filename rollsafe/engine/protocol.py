"""The generation-engine protocol (docs/design.md section 8): what every engine speaks.

An engine serves calls ``(call_id, prompt_tokens, sampling)``, streams each call's tokens, and
supports *cuts*: ``cut(call_ids)`` freezes each call at its current token count and returns a
:class:`PrefixRecord` per call (or a :class:`CutRefusal` naming why not); ``release`` lets
frozen calls go on in place (a checkpoint that committed); ``resume(request, prefix)`` continues
a call from its record on any engine with the same model, with the remaining token budget.

Resume is exact because sampling noise is a pure function of ``(seed, position)``
(:mod:`rollsafe.engine.sampling`): a call resumed at token ``n`` makes the tokens the
uninterrupted call made from ``n`` on, given the same weights.

The prefix record is digested (sha256 over a canonical encoding, :func:`prefix_digest`);
``resume`` refuses a record whose digest, prompt digest, sampling or model differ
(:class:`~rollsafe.errors.PrefixMismatch`), never silently restarting.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from rollsafe.errors import InvalidInput, PrefixMismatch

# Route reads for a cut inventory go to the engine loop in batches of at most this many calls.
CUT_BATCH = 64

FinishReason = Literal["stop", "length"]
Route = tuple[tuple[int, ...], ...]  # the experts each layer chose for one token: [layer][k]
# Why a call was not cut (docs/generation-cuts.md). ``finished`` and ``abandoned``: the call ended
# here (its completion delivered, or its caller walked away); ``not_admitted``: never seen here
# (no token to keep; it runs when it arrives); ``unknown_call``: an engine that cannot tell
# those apart. None of the four loses a generated token, so none is cut again.
RefusalReason = Literal[
    "finished",
    "abandoned",
    "not_admitted",
    "unknown_call",
    "no_tokens",
    "constrained_decoding",
    # Never an engine's answer: the controller's, for the calls of an engine that did not
    # answer the cut (dead, unreachable, or past the deadline): they restart from their turn.
    "engine_unavailable",
]

_HEX64 = r"^[0-9a-f]{64}$"
# Ints on the wire are strict: a JSON ``true``, ``1.0`` or ``"1"`` is refused by name, never
# taken as token 1 (lax validation would). Python callers hand over ints (:func:`plain_ints`).
TokenIds = tuple[StrictInt, ...]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingParams(_Model):
    """How one call samples. ``seed`` and the token position fix the noise of every draw."""

    seed: StrictInt = Field(ge=0, lt=2**63)
    temperature: float = Field(default=1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # At most the engine's context less the prompt: checked at admission, where the engine's
    # context is known (EngineLoop._check_request).
    max_tokens: StrictInt = Field(default=64, ge=1)
    stop_token_ids: TokenIds = ()
    # Not empty: an empty set can sample nothing, a malformed request rather than a call that
    # fails in the engine (it did, as a retryable 503).
    allowed_token_ids: TokenIds | None = Field(
        default=None,
        min_length=1,
        description="constrained decoding: only these tokens may be sampled. Such calls are "
        "refused by cut (a grammar's state is not part of a prefix record).",
    )


class GenerateRequest(_Model):
    call_id: str = Field(min_length=1, max_length=256)
    prompt_tokens: TokenIds = Field(min_length=1)
    sampling: SamplingParams


class TokenEvent(_Model):
    """One generated token. ``route``: the experts each layer chose for the forward pass whose
    logits this token was sampled from (``[layer][k]``), MoE models only."""

    kind: Literal["token"] = "token"
    call_id: str
    index: int = Field(ge=0, description="position among the call's generated tokens")
    token: int
    logprob: float
    weight_version: int
    route: Route | None = None


class FinishEvent(_Model):
    kind: Literal["finish"] = "finish"
    call_id: str
    reason: FinishReason
    n_tokens: int = Field(ge=0)
    detail: str = ""


StreamEvent = TokenEvent | FinishEvent


class Completion(_Model):
    """A call's whole output, assembled from its stream (resumed prefix included)."""

    call_id: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_versions: tuple[int, ...]
    routes: tuple[Route, ...] | None
    finish_reason: FinishReason


class PrefixRecord(_Model):
    """A call frozen at ``len(tokens)``: everything needed to resume it exactly, and a digest.

    ``model`` fingerprints the architecture (not the weights: weight updates between cut and
    resume are legal and show in ``weight_versions``). ``routes`` is present for MoE models.
    """

    format_version: Literal[1] = 1
    call_id: str = Field(min_length=1, max_length=256)
    model: str = Field(pattern=_HEX64)
    prompt_digest: str = Field(pattern=_HEX64)
    sampling: SamplingParams
    tokens: TokenIds = Field(min_length=1)
    logprobs: tuple[float, ...]
    weight_versions: tuple[int, ...]
    routes: tuple[Route, ...] | None = None
    digest: str = Field(pattern=_HEX64)

    @model_validator(mode="after")
    def _aligned(self) -> PrefixRecord:
        n = len(self.tokens)
        for name in ("logprobs", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} tokens")
        if self.routes is not None and len(self.routes) != n:
            raise ValueError(f"routes has {len(self.routes)} entries for {n} tokens")
        if n > self.sampling.max_tokens:
            raise ValueError(f"{n} tokens exceed max_tokens={self.sampling.max_tokens}")
        return self

    def verify(self) -> None:
        """Raise :class:`PrefixMismatch` unless the digest matches the record's content."""
        actual = prefix_digest(self)
        if actual != self.digest:
            raise PrefixMismatch(
                self.call_id,
                "digest",
                f"record says {self.digest[:12]}…, content is {actual[:12]}…",
            )

    def check_request(self, request: GenerateRequest, model: str) -> None:
        """Raise :class:`PrefixMismatch` unless this record continues ``request`` on ``model``."""
        self.verify()
        call = request.call_id
        if self.call_id != call:
            raise PrefixMismatch(call, "call_id", f"record is for call {self.call_id!r}")
        if self.model != model:
            raise PrefixMismatch(
                call, "model", f"record is for model {self.model[:12]}…, engine is {model[:12]}…"
            )
        prompt = prompt_digest(request.prompt_tokens)
        if self.prompt_digest != prompt:
            raise PrefixMismatch(
                call, "prompt_digest", f"record {self.prompt_digest[:12]}…, prompt {prompt[:12]}…"
            )
        if self.sampling != request.sampling:
            raise PrefixMismatch(
                call, "sampling", f"record {self.sampling}, request {request.sampling}"
            )


class CutRefusal(_Model):
    """A call that could not be cut; it restarts from its turn."""

    call_id: str
    reason: RefusalReason
    detail: str = ""


class CutReport(_Model):
    prefixes: tuple[PrefixRecord, ...]
    refused: tuple[CutRefusal, ...]
    handoffs: int = Field(ge=0, description="hand-offs to the engine loop this cut took")


class EngineInfo(_Model):
    model: str = Field(pattern=_HEX64, description="architecture fingerprint")
    kind: Literal["dense", "moe"]
    weight_version: int
    active: int = Field(ge=0, description="calls generating")
    frozen: int = Field(ge=0, description="calls frozen by a cut")
    held: int = Field(
        default=0, ge=0, description="generating calls stopped by a test's hold rule, until a cut"
    )
    handoffs: int = Field(ge=0, description="hand-offs to the engine loop since start")


@runtime_checkable
class Engine(Protocol):
    """What the checkpoint phases and the environments rely on. Async; many calls at once."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]: ...

    def resume(self, request: GenerateRequest, prefix: PrefixRecord) -> AsyncIterator[StreamEvent]:
        """The call's stream from token ``len(prefix.tokens)`` on (the prefix is not repeated)."""
        ...

    async def cut(self, call_ids: Sequence[str], *, batch_size: int = CUT_BATCH) -> CutReport:
        """Freeze ``call_ids``, at most ``batch_size`` calls per hand-off to the engine loop."""
        ...

    async def release(self, call_ids: Sequence[str]) -> int:
        """Let frozen calls go on generating where they were frozen; how many were frozen."""
        ...

    async def info(self) -> EngineInfo: ...


def plain_ints(values: Iterable[int | np.integer[Any]]) -> tuple[int, ...]:
    """``values`` with numpy's integers made Python ints, which the strict wire models take
    (a tokenizer's output often holds numpy's). Anything else is left for the model to judge:
    a bool or a float is refused there, not converted here."""
    return tuple(int(v) if isinstance(v, np.integer) else v for v in values)


def prompt_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()


def prefix_digest(record: PrefixRecord) -> str:
    """sha256 over the record's fields: JSON for the scalars, little-endian bytes for arrays.

    Logprobs are hashed as float32 (what the engine produces), so a record that went through
    JSON or the data plane and back keeps its digest bit for bit.
    """
    meta = {
        "format_version": record.format_version,
        "call_id": record.call_id,
        "model": record.model,
        "prompt_digest": record.prompt_digest,
        "sampling": record.sampling.model_dump(mode="json"),
        "has_routes": record.routes is not None,
    }
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    digest.update(np.asarray(record.tokens, dtype="<i8").tobytes())
    digest.update(np.asarray(record.logprobs, dtype="<f4").tobytes())
    digest.update(np.asarray(record.weight_versions, dtype="<i8").tobytes())
    if record.routes is not None:
        digest.update(np.asarray(record.routes, dtype="<i2").tobytes())
    return digest.hexdigest()


def seal_prefix(**fields: object) -> PrefixRecord:
    """A :class:`PrefixRecord` from its fields, with its digest computed."""
    unsealed = PrefixRecord.model_validate({**fields, "digest": "0" * 64})
    return unsealed.model_copy(update={"digest": prefix_digest(unsealed)})


def completion_of(
    call_id: str, events: Sequence[StreamEvent], prefix: PrefixRecord | None = None
) -> Completion:
    """Assemble a :class:`Completion` from a call's stream (after ``prefix``, if it resumed)."""
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    finish = [e for e in events if isinstance(e, FinishEvent)]
    if len(finish) != 1 or not isinstance(events[-1], FinishEvent):
        raise InvalidInput(f"call {call_id}: stream did not end with exactly one finish event")
    head_tokens = prefix.tokens if prefix else ()
    head_logprobs = prefix.logprobs if prefix else ()
    head_versions = prefix.weight_versions if prefix else ()
    routes = None
    if (tokens and tokens[0].route is not None) or (prefix and prefix.routes is not None):
        head_routes = prefix.routes if prefix and prefix.routes is not None else ()
        routes = head_routes + tuple(e.route or () for e in tokens)
    return Completion(
        call_id=call_id,
        tokens=head_tokens + tuple(e.token for e in tokens),
        logprobs=head_logprobs + tuple(e.logprob for e in tokens),
        weight_versions=head_versions + tuple(e.weight_version for e in tokens),
        routes=routes,
        finish_reason=finish[0].reason,
    )
