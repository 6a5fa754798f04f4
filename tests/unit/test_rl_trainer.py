"""The reference learner: GRPO advantages, the sign and determinism of a step, routing replay,
and checkpoints that continue bitwise and refuse anything tampered with."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from rollsafe.engine.model import ModelConfig, TinyTransformer
from rollsafe.errors import InvalidInput, SchemaMismatch, SnapshotCorrupt
from rollsafe.reference.rl.trainer import (
    OPTIMIZER_FILE,
    WEIGHTS_FILE,
    PolicyTrainer,
    Sample,
    group_advantages,
)
from rollsafe.snapshot.tensorfile import HashingWriter, read_tensors, write_tensors

KINDS = ["dense", "moe"]
PROMPT = (3, 17, 40, 5)


def config(kind: str = "dense", **changes: int) -> ModelConfig:
    fields = {"vocab_size": 64, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32}
    fields["max_positions"] = 64
    return ModelConfig(kind=kind, **{**fields, **changes})


def groups(offset: int = 0) -> list[list[Sample]]:
    """Two groups of three: one with a reward spread, one with a sample that generated nothing."""
    return [
        [
            Sample(prompt_tokens=PROMPT, tokens=(10 + offset, 11, 12), reward=1.0),
            Sample(prompt_tokens=PROMPT, tokens=(20, 21 + offset), reward=0.0),
            Sample(prompt_tokens=PROMPT, tokens=(30, 31, 32, 33), reward=0.5),
        ],
        [
            Sample(prompt_tokens=(7, 8), tokens=(9, 1 + offset), reward=2.0),
            Sample(prompt_tokens=(7, 8), tokens=(), reward=-1.0),
            Sample(prompt_tokens=(7, 8), tokens=(4,), reward=0.0),
        ],
    ]


def logprob(model: torch.nn.Module, sample: Sample) -> float:
    """Summed log p of the sample's generated tokens, measured independently of the trainer."""
    sequence = [*sample.prompt_tokens, *sample.tokens]
    with torch.no_grad():
        logits, _ = model(torch.tensor([sequence]))
    logprobs = torch.log_softmax(logits[0], dim=-1)
    start = len(sample.prompt_tokens)
    return sum(float(logprobs[p - 1, sequence[p]]) for p in range(start, len(sequence)))


def assert_same_weights(a: PolicyTrainer, b: PolicyTrainer) -> None:
    wa, wb = a.weights(), b.weights()
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


# -- advantages ----------------------------------------------------------------------------------


def test_advantages_are_group_normalised() -> None:
    got = group_advantages([1.0, 0.0, 0.5, 0.5])
    mean, std = 0.5, math.sqrt((0.25 + 0.25) / 4)  # population std
    assert got == pytest.approx([(r - mean) / (std + 1e-6) for r in (1.0, 0.0, 0.5, 0.5)])
    # Population std: sqrt(2); the sample std would give sqrt(1.5).
    assert got == pytest.approx([math.sqrt(2), -math.sqrt(2), 0.0, 0.0], rel=1e-5)
    assert group_advantages([2.0, 4.0], eps=0.0) == [-1.0, 1.0]


def test_a_group_with_equal_rewards_has_no_signal() -> None:
    # 0.1 * 3 / 3 is not exactly 0.1: the mean's rounding must not become a tiny signal.
    assert group_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]
    assert group_advantages([0.7, 0.7]) == [0.0, 0.0]
    assert group_advantages([5.0]) == [0.0]


@pytest.mark.parametrize("rewards", [[], [1.0, math.nan], [math.inf, 0.0], [-math.inf]])
def test_advantages_refuse_empty_or_non_finite(rewards: list[float]) -> None:
    with pytest.raises(InvalidInput):
        group_advantages(rewards)


def test_samples_are_validated() -> None:
    with pytest.raises(ValidationError):
        Sample(prompt_tokens=(), tokens=(1,), reward=0.0)
    with pytest.raises(ValidationError):
        Sample(prompt_tokens=(1,), tokens=(1,), reward=math.nan)
    with pytest.raises(ValidationError):
        Sample(prompt_tokens=(1,), tokens=(1, 2), reward=0.0, routes=(((0, 1),),))
    with pytest.raises(ValidationError):
        Sample(prompt_tokens=(1,), tokens=(1,), reward=0.0, extra=1)  # type: ignore[call-arg]
    trainer = PolicyTrainer(config(), 0)
    with pytest.raises(InvalidInput):
        trainer.train_step([[Sample(prompt_tokens=(1,), tokens=(64,), reward=0.0)]])
    routed = Sample(prompt_tokens=(1,), tokens=(2,), reward=0.0, routes=(((0, 1),),))
    with pytest.raises(InvalidInput, match="dense"):  # well-shaped routes, but a dense model
        trainer.train_step([[routed]])
    with pytest.raises(InvalidInput):
        trainer.train_step([[Sample(prompt_tokens=(1,), tokens=(), reward=1.0)]])
    assert trainer.step == 0 and trainer.weight_version == 0


# -- a step --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_raises_the_rewarded_tokens_and_lowers_the_others(kind: str) -> None:
    trainer = PolicyTrainer(config(kind), 5, lr=1e-2)
    good = Sample(prompt_tokens=PROMPT, tokens=(10, 11, 12), reward=1.0)
    bad = Sample(prompt_tokens=PROMPT, tokens=(20, 21, 22), reward=0.0)
    before = logprob(trainer.model, good), logprob(trainer.model, bad)
    result = trainer.train_step([[good, bad]])
    after = logprob(trainer.model, good), logprob(trainer.model, bad)
    assert after[0] > before[0] + 1e-3
    assert after[1] < before[1] - 1e-3
    assert (result.step, result.weight_version, result.n_samples, result.n_tokens) == (1, 1, 2, 6)
    assert result.mean_reward == 0.5


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_groups_same_weights_bitwise(kind: str) -> None:
    a, b = PolicyTrainer(config(kind), 7), PolicyTrainer(config(kind), 7)
    initial = a.weights()
    for step in range(1, 4):
        ra, rb = a.train_step(groups(step)), b.train_step(groups(step))
        assert ra == rb
        assert (ra.step, ra.weight_version, a.step, a.weight_version) == (step,) * 4
    assert_same_weights(a, b)
    assert any(not torch.equal(initial[n], w) for n, w in a.weights().items())


@pytest.mark.parametrize("kind", KINDS)
def test_initial_weights_are_the_engines(kind: str) -> None:
    trainer = PolicyTrainer(config(kind), 11)
    fresh = TinyTransformer(config(kind), 11).state_dict()
    weights = trainer.weights()
    assert weights.keys() == fresh.keys()
    assert all(torch.equal(weights[name], fresh[name]) for name in fresh)
    # Copies, detached: a later step does not change what was pushed to an engine.
    assert all(not w.requires_grad for w in weights.values())
    trainer.train_step(groups())
    assert all(torch.equal(weights[name], fresh[name]) for name in fresh)


# -- routing replay ------------------------------------------------------------------------------


def engine_rollout(model: TinyTransformer, prompt: tuple[int, ...], n: int) -> Sample:
    """Greedy tokens and routes recorded the way the engine records them (``model.step``)."""
    cache = model.new_cache(64)
    for token in prompt:
        logits, route = model.step(token, cache)
    tokens, routes = [], []
    for index in range(n):
        token = int(torch.argmax(logits))
        tokens.append(token)
        routes.append(route)
        if index < n - 1:
            logits, route = model.step(token, cache)
    return Sample(prompt_tokens=prompt, tokens=tuple(tokens), reward=0.0, routes=tuple(routes))


def moe_loss(sample: Sample, other: Sample) -> float:
    trainer = PolicyTrainer(config("moe", n_layers=2, n_experts=4, top_k=2), 3)
    return trainer.train_step([[sample, other]]).loss


def test_routes_recorded_by_the_engine_replay_to_the_models_own_choice() -> None:
    model = TinyTransformer(config("moe", n_layers=2, n_experts=4, top_k=2), 3)
    recorded = engine_rollout(model, PROMPT, 5)
    other = Sample(prompt_tokens=PROMPT, tokens=(1, 2), reward=1.0)
    fresh = recorded.model_copy(update={"routes": None})
    # Same experts as the model would choose, position for position: the same loss.
    assert moe_loss(recorded, other) == pytest.approx(moe_loss(fresh, other), rel=1e-6)


def test_recorded_routes_are_used_in_the_training_forward() -> None:
    model = TinyTransformer(config("moe", n_layers=2, n_experts=4, top_k=2), 3)
    recorded = engine_rollout(model, PROMPT, 5)
    assert recorded.routes is not None
    shifted = tuple(
        tuple(tuple((e + 1) % 4 for e in layer) for layer in route) for route in recorded.routes
    )
    other = Sample(prompt_tokens=PROMPT, tokens=(1, 2), reward=1.0)
    replayed = recorded.model_copy(update={"routes": shifted})
    assert moe_loss(replayed, other) != pytest.approx(moe_loss(recorded, other), rel=1e-4)
    # Only the last route differs: the last generated position is replayed too.
    last = recorded.model_copy(update={"routes": (*recorded.routes[:-1], shifted[-1])})
    assert moe_loss(last, other) != pytest.approx(moe_loss(recorded, other), rel=1e-4)


def test_malformed_routes_are_refused() -> None:
    trainer = PolicyTrainer(config("moe", n_layers=2, n_experts=4, top_k=2), 3)
    for routes in [(((0, 1),),), (((0, 1), (0, 4)),), (((0,), (1,)),)]:
        sample = Sample(prompt_tokens=PROMPT, tokens=(1,), reward=0.0, routes=routes)
        with pytest.raises(InvalidInput):
            trainer.train_step([[sample]])


# -- checkpoints ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("saved_at", [0, 2])
def test_a_loaded_trainer_continues_bitwise(tmp_path: Path, kind: str, saved_at: int) -> None:
    straight = PolicyTrainer(config(kind), 4, lr=3e-3)
    cut = PolicyTrainer(config(kind), 4, lr=3e-3)
    for step in range(saved_at):
        straight.train_step(groups(step))
        cut.train_step(groups(step))
    manifest = cut.save(tmp_path / "ckpt")
    assert (manifest.step, manifest.weight_version) == (saved_at, saved_at)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "manifest.json",
        OPTIMIZER_FILE,
        WEIGHTS_FILE,
    ]
    resumed = PolicyTrainer.load(tmp_path / "ckpt", config(kind), lr=3e-3)
    assert (resumed.step, resumed.weight_version) == (saved_at, saved_at)
    assert_same_weights(resumed, straight)
    for step in range(saved_at, saved_at + 2):
        assert resumed.train_step(groups(step)) == straight.train_step(groups(step))
    assert_same_weights(resumed, straight)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    trainer = PolicyTrainer(config(), 2)
    trainer.train_step(groups())
    directory = tmp_path / "ckpt"
    trainer.save(directory)
    return directory


def test_optimizer_state_is_keyed_by_parameter_name(saved: Path) -> None:
    tensors, _ = read_tensors((saved / OPTIMIZER_FILE).read_bytes(), OPTIMIZER_FILE)
    names = [name for name, _ in TinyTransformer(config()).named_parameters()]
    expected = {f"{n}.{key}" for n in names for key in ("exp_avg", "exp_avg_sq", "step")}
    assert set(tensors) == expected
    assert float(tensors["head.weight.step"]) == 1.0


@pytest.mark.parametrize("name", [WEIGHTS_FILE, OPTIMIZER_FILE])
def test_a_flipped_byte_is_refused(saved: Path, name: str) -> None:
    data = bytearray((saved / name).read_bytes())
    data[-3] ^= 0x01
    (saved / name).write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match=re.escape(name)):
        PolicyTrainer.load(saved, config())


@pytest.mark.parametrize("name", [WEIGHTS_FILE, OPTIMIZER_FILE, "manifest.json"])
def test_a_missing_file_is_refused(saved: Path, name: str) -> None:
    (saved / name).unlink()
    with pytest.raises(SnapshotCorrupt, match=re.escape(name)):
        PolicyTrainer.load(saved, config())


def rewrite(saved: Path, name: str, change: dict[str, np.ndarray], drop: str = "") -> None:
    """Rewrite one tensor file and its manifest entry, so that only the content is wrong."""
    tensors, _ = read_tensors((saved / name).read_bytes(), name)
    tensors = {k: v for k, v in tensors.items() if k != drop} | change
    (saved / name).unlink()
    with open(saved / name, "xb") as handle:
        out = HashingWriter(handle)
        write_tensors(out, tensors)
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": out.hexdigest(), "bytes": out.size}
    (saved / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", [WEIGHTS_FILE, OPTIMIZER_FILE])
def test_an_extra_tensor_is_refused(saved: Path, name: str) -> None:
    rewrite(saved, name, {"smuggled.weight": np.zeros(3, np.float32)})
    with pytest.raises(SnapshotCorrupt, match=r"unexpected tensors smuggled\.weight"):
        PolicyTrainer.load(saved, config())


@pytest.mark.parametrize(
    ("name", "tensor"), [(WEIGHTS_FILE, "head.weight"), (OPTIMIZER_FILE, "norm.bias.exp_avg_sq")]
)
def test_a_missing_tensor_is_refused(saved: Path, name: str, tensor: str) -> None:
    rewrite(saved, name, {}, drop=tensor)
    with pytest.raises(SnapshotCorrupt, match=re.escape(f"missing tensors {tensor}")):
        PolicyTrainer.load(saved, config())


def test_a_tensor_of_the_wrong_shape_is_refused(saved: Path) -> None:
    rewrite(saved, WEIGHTS_FILE, {"head.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(SnapshotCorrupt, match=r"head\.weight"):
        PolicyTrainer.load(saved, config())


def edit_manifest(saved: Path, **changes: object) -> None:
    manifest = json.loads((saved / "manifest.json").read_text())
    (saved / "manifest.json").write_text(json.dumps(manifest | changes))


def test_an_unknown_manifest_field_is_refused(saved: Path) -> None:
    edit_manifest(saved, pickled_optimizer="gASV")
    with pytest.raises(SnapshotCorrupt, match="pickled_optimizer"):
        PolicyTrainer.load(saved, config())


def test_another_format_version_is_refused(saved: Path) -> None:
    edit_manifest(saved, format_version=2)
    with pytest.raises(SchemaMismatch, match="format_version 2"):
        PolicyTrainer.load(saved, config())


def test_another_model_is_refused_naming_both(saved: Path) -> None:
    other = config(d_ff=64)
    with pytest.raises(SchemaMismatch) as caught:
        PolicyTrainer.load(saved, other)
    assert config().fingerprint() in str(caught.value)
    assert other.fingerprint() in str(caught.value)


def test_other_hyperparameters_are_refused(saved: Path) -> None:
    with pytest.raises(SchemaMismatch, match="lr"):
        PolicyTrainer.load(saved, config(), lr=1e-2)


def test_an_extra_file_is_refused(saved: Path) -> None:
    (saved / "notes.txt").write_text("hello")
    with pytest.raises(SnapshotCorrupt, match=r"notes\.txt"):
        PolicyTrainer.load(saved, config())


def test_saving_into_a_non_empty_directory_is_refused(saved: Path, tmp_path: Path) -> None:
    trainer = PolicyTrainer(config(), 2)
    with pytest.raises(InvalidInput, match="not empty"):
        trainer.save(saved)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidInput):
        trainer.save(tmp_path / "file")
    trainer.save(tmp_path / "empty")  # a directory that does not exist yet is fine


# -- a Hugging Face policy (what the vLLM engine serves: rollsafe demo --engine vllm) -----------


def test_a_hugging_face_policy_trains_and_continues_bitwise(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    from safetensors import safe_open

    from rollsafe.reference.rl.policy import HfModel

    model = HfModel(path=tiny_models["dense"])
    straight, cut = PolicyTrainer(model, 0, lr=3e-3), PolicyTrainer(model, 0, lr=3e-3)
    with safe_open(str(model.path / "model.safetensors"), "pt") as checkpoint:
        assert straight.weights().keys() == set(checkpoint.keys())  # the engine's names
    good = Sample(prompt_tokens=PROMPT, tokens=(10, 11, 12), reward=1.0)
    bad = Sample(prompt_tokens=PROMPT, tokens=(20, 21, 22), reward=0.0)
    before = [float(straight._token_logprobs(s).sum()) for s in (good, bad)]
    straight.train_step([[good, bad]])
    cut.train_step([[good, bad]])
    after = [float(straight._token_logprobs(s).sum()) for s in (good, bad)]
    assert after[0] > before[0] and after[1] < before[1]
    cut.save(tmp_path / "ckpt")
    resumed = PolicyTrainer.load(tmp_path / "ckpt", model, lr=3e-3)
    assert resumed.train_step(groups()) == straight.train_step(groups())
    assert_same_weights(resumed, straight)
    with pytest.raises(SchemaMismatch, match="model"):
        PolicyTrainer.load(tmp_path / "ckpt", config())


def test_a_hugging_face_moe_policy_is_refused_by_name(tiny_models: dict[str, Path]) -> None:
    from rollsafe.reference.rl.policy import HfModel

    with pytest.raises(InvalidInput, match="mixture-of-experts"):
        PolicyTrainer(HfModel(path=tiny_models["moe"]), 0)
    with pytest.raises(InvalidInput, match=r"no config\.json"):
        PolicyTrainer(HfModel(path=tiny_models["moe"] / "nothing"), 0)
