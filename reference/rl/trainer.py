"""The reference run's learner: GRPO-style policy gradient on the engine's own model.

The trainer holds the engine's own model (:mod:`rollsafe.reference.rl.policy`): a
:class:`~rollsafe.engine.model.TinyTransformer` built from the same config and seed as the
reference engine, or the Hugging Face directory the vLLM engine serves, so both start from the
same policy; after each optimizer step its
:meth:`PolicyTrainer.weights` go to the engine with ``update_weights(weights, weight_version)``.

A trainer checkpoint is a directory of three files, none of which can execute code on load::

    weights.safetensors    the model's state dict
    optimizer.safetensors  AdamW state keyed by parameter name: <param>.exp_avg, .exp_avg_sq, .step
    manifest.json          written last: step, versions, fingerprint, hyperparameters, sha256s
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollsafe.dataplane.columnar import fsync_directory, prepare_empty_directory
from rollsafe.engine.model import ModelConfig
from rollsafe.errors import InvalidInput, SchemaMismatch, SnapshotCorrupt
from rollsafe.reference.rl import policy
from rollsafe.reference.rl.policy import PolicyModel
from rollsafe.snapshot.tensorfile import HashingWriter, read_tensors, write_tensors

FORMAT_VERSION: Final = 1
WEIGHTS_FILE: Final = "weights.safetensors"
OPTIMIZER_FILE: Final = "optimizer.safetensors"
MANIFEST_FILE: Final = "manifest.json"
# AdamW's hyperparameters besides lr are fixed: the manifest records them so a checkpoint
# made by a trainer with other values is refused instead of silently continued differently.
BETAS: Final = (0.9, 0.999)
EPS: Final = 1e-8
WEIGHT_DECAY: Final = 0.0
_STATE: Final = ("exp_avg", "exp_avg_sq", "step")

Token = Annotated[int, Field(ge=0)]
Expert = Annotated[int, Field(ge=0)]


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """GRPO: ``(r - mean) / (std + eps)`` with the population std. A group whose rewards are all
    equal carries no signal and gets zeros (its std is 0, so the formula would give 0 anyway;
    the explicit case keeps float noise in the mean from turning into tiny advantages)."""
    if not rewards:
        raise InvalidInput("a group needs at least one reward")
    values = [float(r) for r in rewards]
    if not all(math.isfinite(r) for r in values):
        raise InvalidInput(f"rewards must be finite, got {values}")
    if all(r == values[0] for r in values):
        return [0.0] * len(values)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((r - mean) ** 2 for r in values) / len(values))
    return [(r - mean) / (std + eps) for r in values]


class Sample(BaseModel):
    """One rollout. ``routes`` (MoE): per generated token, per layer, the experts the engine
    chose for the forward pass whose logits that token was sampled from (``TokenEvent.route``);
    the training forward replays them so it sees the same experts ("routing replay")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: tuple[Token, ...] = Field(min_length=1)
    tokens: tuple[Token, ...] = ()
    reward: float = Field(allow_inf_nan=False)
    routes: tuple[tuple[tuple[Expert, ...], ...], ...] | None = None

    @model_validator(mode="after")
    def _one_route_per_token(self) -> Sample:
        if self.routes is not None and len(self.routes) != len(self.tokens):
            raise ValueError(f"routes has {len(self.routes)} entries for {len(self.tokens)} tokens")
        return self


class StepResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int = Field(ge=1, description="the optimizer step just committed")
    weight_version: int = Field(ge=1)
    loss: float
    mean_reward: float
    n_samples: int = Field(ge=1)
    n_tokens: int = Field(ge=1, description="generated tokens that were trained on")


class CheckpointFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)


class TrainerCheckpointManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format_version: int
    step: int = Field(ge=0)
    weight_version: int = Field(ge=0)
    model: str = Field(description="fingerprint() of the trained model")
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    files: dict[str, CheckpointFile]


class PolicyTrainer:
    """REINFORCE with the group-mean baseline (GRPO advantages), one AdamW step per batch."""

    def __init__(self, config: PolicyModel, seed: int, *, lr: float = 1e-3) -> None:
        self.config = config
        self.lr = lr
        self.model = policy.build(config, seed)
        self.model.train()  # no dropout in the model: train and eval compute the same
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
        )
        self.step = 0
        self.weight_version = 0

    def train_step(self, groups: Sequence[Sequence[Sample]]) -> StepResult:
        """One optimizer step on a batch of fresh rollouts.

        ``loss = -(1/N) sum_i A_i * mean_t log p(token_t | prompt + tokens_<t)`` over all N
        samples. No importance ratio and no clipping: the rollouts come from the current weights
        and each batch is used for exactly one optimizer step, so the ratio would be 1 (on-policy
        REINFORCE). Samples with no generated tokens contribute nothing but count in N.

        Each sample runs its own forward at batch size 1: sequences differ in length, and
        without padding the arithmetic of a sample does not depend on its batch-mates.
        """
        samples = [sample for group in groups for sample in group]
        if not samples:
            raise InvalidInput("train_step needs at least one sample")
        advantages = [a for group in groups for a in group_advantages([s.reward for s in group])]
        n_tokens = sum(len(s.tokens) for s in samples)
        if n_tokens == 0:
            raise InvalidInput("no sample has generated tokens: nothing to train on")
        for sample in samples:
            self._check(sample)
        total: torch.Tensor | None = None
        for sample, advantage in zip(samples, advantages, strict=True):
            if not sample.tokens:
                continue
            term = advantage * self._token_logprobs(sample).mean()
            total = term if total is None else total + term
        assert total is not None
        loss = -total / len(samples)
        self.optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self.step += 1
        self.weight_version += 1
        return StepResult(
            step=self.step,
            weight_version=self.weight_version,
            loss=float(loss.item()),
            mean_reward=sum(s.reward for s in samples) / len(samples),
            n_samples=len(samples),
            n_tokens=n_tokens,
        )

    def _check(self, sample: Sample) -> None:
        c = self.config
        length = len(sample.prompt_tokens) + len(sample.tokens) - 1
        if length > c.max_positions:
            raise InvalidInput(f"sample of {length} positions exceeds {c.max_positions}")
        if max((*sample.prompt_tokens, *sample.tokens)) >= c.vocab_size:
            raise InvalidInput(f"sample has a token id outside the vocabulary of {c.vocab_size}")
        if sample.routes is None:
            return
        if not isinstance(c, ModelConfig) or c.kind != "moe":
            raise InvalidInput("routes given for a dense model")
        for route in sample.routes:
            if len(route) != c.n_layers or any(
                len(layer) != c.top_k or max(layer) >= c.n_experts for layer in route
            ):
                raise InvalidInput(
                    f"route {route} is not {c.n_layers} layers of {c.top_k} experts "
                    f"below {c.n_experts}"
                )

    def _token_logprobs(self, sample: Sample) -> torch.Tensor:
        """``log p(tokens[t] | prompt + tokens[:t])`` for every generated token, with grad.

        The input is ``prompt + tokens[:-1]``: position ``P - 1 + t`` (P = prompt length) yields
        the logits tokens[t] was sampled from, and is where the engine recorded ``routes[t]``.
        The engine records no route for the earlier prompt positions, so the model chooses
        them: a no-grad forward without replay gives its choices there (the forward is causal,
        so the choice at a position does not depend on the replayed later ones), and the
        recorded routes overwrite positions ``P - 1`` onwards.
        """
        prompt = len(sample.prompt_tokens)
        inputs = torch.tensor([[*sample.prompt_tokens, *sample.tokens[:-1]]])
        routes = None
        if sample.routes is not None:
            with torch.no_grad():
                _, chosen = policy.forward(self.config, self.model, inputs, None)
            assert chosen is not None  # _check: routes only for a reference MoE
            routes = chosen.clone()
            routes[0, prompt - 1 :] = torch.tensor(sample.routes, dtype=routes.dtype)
        logits, _ = policy.forward(self.config, self.model, inputs, routes)
        logprobs = F.log_softmax(logits[0, prompt - 1 :], dim=-1)
        targets = torch.tensor(sample.tokens).unsqueeze(1)
        return logprobs.gather(1, targets).squeeze(1)

    def weights(self) -> dict[str, torch.Tensor]:
        """Detached copies of the state dict: later steps do not change what was pushed."""
        return {name: t.detach().clone() for name, t in self.model.state_dict().items()}

    # -- checkpoint ----------------------------------------------------------------------------

    def save(self, directory: Path) -> TrainerCheckpointManifest:
        """Write a checkpoint into ``directory``, which must not exist or be empty."""
        weights = {name: _array(t) for name, t in self.model.state_dict().items()}
        optimizer: dict[str, np.ndarray] = {}
        for name, param in self.model.named_parameters():
            state = self.optimizer.state.get(param, {})
            if self.step and set(state) != set(_STATE):  # every parameter gets a gradient
                raise InvalidInput(f"optimizer state of {name} has {sorted(state)}")
            optimizer.update({f"{name}.{key}": _array(state[key]) for key in sorted(state)})
        directory = Path(directory)
        prepare_empty_directory(directory)
        files = {
            WEIGHTS_FILE: _write(directory / WEIGHTS_FILE, weights),
            OPTIMIZER_FILE: _write(directory / OPTIMIZER_FILE, optimizer),
        }
        fsync_directory(directory)
        manifest = TrainerCheckpointManifest(
            format_version=FORMAT_VERSION,
            step=self.step,
            weight_version=self.weight_version,
            model=self.config.fingerprint(),
            lr=self.lr,
            betas=BETAS,
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            files=files,
        )
        # The manifest comes last: a checkpoint cut short by a crash has none and is refused.
        with open(directory / MANIFEST_FILE, "xb") as handle:
            handle.write(manifest.model_dump_json(indent=2).encode())
            handle.flush()
            os.fsync(handle.fileno())
        fsync_directory(directory)
        return manifest

    @classmethod
    def load(cls, directory: Path, config: PolicyModel, *, lr: float = 1e-3) -> PolicyTrainer:
        """The trainer saved in ``directory``, after verifying every file against the manifest.

        The next :meth:`train_step` gives bitwise what the saved trainer's would have."""
        directory = Path(directory)
        manifest = _read_manifest(directory)
        present = {p.name for p in directory.iterdir()} if directory.is_dir() else set()
        expected = {MANIFEST_FILE, WEIGHTS_FILE, OPTIMIZER_FILE}
        if manifest.files.keys() != expected - {MANIFEST_FILE}:
            raise SnapshotCorrupt(f"{directory}: manifest lists {sorted(manifest.files)}")
        if missing := sorted(expected - present):
            raise SnapshotCorrupt(f"{directory}: missing {', '.join(missing)}")
        if extra := sorted(present - expected):
            raise SnapshotCorrupt(f"{directory}: files not in a checkpoint: {', '.join(extra)}")
        contents: dict[str, bytes] = {}
        for name, entry in sorted(manifest.files.items()):
            data = (directory / name).read_bytes()
            if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
                raise SnapshotCorrupt(f"{directory / name}: size or sha256 differs from manifest")
            contents[name] = data
        if manifest.model != config.fingerprint():
            raise SchemaMismatch(
                f"{directory}: checkpoint is of model {manifest.model}, "
                f"asked to load into model {config.fingerprint()}"
            )
        saved = (manifest.lr, manifest.betas, manifest.eps, manifest.weight_decay)
        if saved != (lr, BETAS, EPS, WEIGHT_DECAY):
            raise SchemaMismatch(
                f"{directory}: AdamW (lr, betas, eps, weight_decay) was {saved}, "
                f"this trainer uses {(lr, BETAS, EPS, WEIGHT_DECAY)}"
            )
        trainer = cls(config, 0, lr=lr)
        shapes = {name: t.shape for name, t in trainer.model.state_dict().items()}
        weights = _tensors(contents, WEIGHTS_FILE, shapes)
        params = dict(trainer.model.named_parameters())
        state = _tensors(
            contents,
            OPTIMIZER_FILE,
            {
                f"{name}.{key}": () if key == "step" else param.shape
                for name, param in params.items()
                for key in _STATE
                if manifest.step  # AdamW holds no state before its first step
            },
        )
        trainer.model.load_state_dict(weights, strict=True)
        # Through load_state_dict, keyed by the optimizer's parameter index, so AdamW places
        # and types its own state as it would have built it.
        index = {name: i for i, name in enumerate(params)}
        optimizer_state = trainer.optimizer.state_dict()
        optimizer_state["state"] = {
            index[name]: {key: state[f"{name}.{key}"] for key in _STATE}
            for name in params
            if manifest.step
        }
        trainer.optimizer.load_state_dict(optimizer_state)
        trainer.step, trainer.weight_version = manifest.step, manifest.weight_version
        return trainer


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().contiguous().numpy()


def _write(path: Path, arrays: Mapping[str, np.ndarray]) -> CheckpointFile:
    with open(path, "xb") as handle:
        out = HashingWriter(handle)
        write_tensors(out, arrays)
        handle.flush()
        os.fsync(handle.fileno())
    return CheckpointFile(sha256=out.hexdigest(), bytes=out.size)


def _read_manifest(directory: Path) -> TrainerCheckpointManifest:
    source = directory / MANIFEST_FILE
    try:
        data = source.read_bytes()
        raw: Any = json.loads(data)
    except FileNotFoundError:
        raise SnapshotCorrupt(f"{source}: missing (no checkpoint, or one cut short)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotCorrupt(f"{source}: unreadable ({exc})") from None
    if not isinstance(raw, dict):
        raise SnapshotCorrupt(f"{source}: not a JSON object")
    # The version first: a newer format may have fields this reader does not know.
    if raw.get("format_version") != FORMAT_VERSION:
        raise SchemaMismatch(
            f"{source}: format_version {raw.get('format_version')!r}, "
            f"this reader reads {FORMAT_VERSION}"
        )
    if unknown := sorted(set(raw) - set(TrainerCheckpointManifest.model_fields)):
        raise SnapshotCorrupt(f"{source}: unknown fields {', '.join(unknown)}")
    try:
        return TrainerCheckpointManifest.model_validate_json(data, strict=True)
    except ValidationError as exc:
        raise SnapshotCorrupt(f"{source}: {exc}") from None


def _tensors(
    contents: Mapping[str, bytes], name: str, shapes: Mapping[str, Sequence[int]]
) -> dict[str, torch.Tensor]:
    """The file's tensors, which must be exactly ``shapes``' names, shapes, all float32."""
    arrays, _ = read_tensors(contents[name], name)
    if missing := sorted(shapes.keys() - arrays.keys()):
        raise SnapshotCorrupt(f"{name}: missing tensors {', '.join(missing)}")
    if extra := sorted(arrays.keys() - shapes.keys()):
        raise SnapshotCorrupt(f"{name}: unexpected tensors {', '.join(extra)}")
    for key, array in arrays.items():
        if array.shape != tuple(shapes[key]) or array.dtype != np.float32:
            raise SnapshotCorrupt(f"{name}: {key} is {array.dtype}{list(array.shape)}")
    # Copies: read_tensors gives read-only views into the file's bytes.
    return {key: torch.from_numpy(array.copy()) for key, array in arrays.items()}
