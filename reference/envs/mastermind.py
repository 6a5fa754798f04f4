"""textarena's Mastermind as a checkpointable environment whose every guess is an effect.

A third party's game used as its docs say (``textarena.make("Mastermind-v0")``, ``reset``,
``step("[1 2 3 4]")``), wrapped the way docs/environment-protocol.md asks: each guess is
*submitted* to an append-only ledger outside the episode's state (a JSON-lines file that
keeps whatever it is given, duplicates included), through ``session.effect``, so it is
submitted once per rollout and turn however often the turn is redone. The record is our own
account of the game (the task and the guesses with their pegs); a restored attempt replays the
guesses into a fresh game, which recomputes textarena's hidden state (the code from the seed,
the history, its turn counter), and the state digest covers that hidden state.

A task is ``{"seed": s, "turns": n}``: at most n guesses (the game's limit is 20), each picked
from the policy's tokens; the episode ends when the code is cracked. ``"play_out": true`` keeps
the policy from guessing the code, so every episode runs all n turns whatever its seeds (a
check that parks an episode after a turn needs it that long). The reward is textarena's:
1 when cracked, else the last guess's completion ((black + white / 2) / 4). Serve it:
``rollsafe env serve --hooks rollsafe.reference.envs.mastermind:Mastermind --engine-url ...
--hooks-option ledger=/path/to/ledger.jsonl``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import textarena as ta
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollsafe.engine.protocol import Completion
from rollsafe.env.effects import EffectKey
from rollsafe.env.hooks import EnvironmentHooks, EpisodeSession
from rollsafe.env.protocol import EpisodeRef, EpisodeResult, RunEpisode
from rollsafe.env.serve import ServeContext
from rollsafe.errors import InvalidInput

GUESSES = tuple(itertools.permutations(range(1, 7), 4))  # the game's codes: 4 distinct of 1..6
MAX_TOKENS = 6


class Task(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = Field(default=0, ge=0)
    turns: int = Field(default=8, ge=1, le=20)
    play_out: bool = False  # never guess the code: all ``turns`` turns are played


class Guess(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    code: tuple[int, ...]
    black: int = Field(ge=0, le=4)
    white: int = Field(ge=0, le=4)


class Game(Task):
    """An episode's record: the task and the guesses so far, with their pegs."""

    guesses: tuple[Guess, ...] = ()
    cracked: bool = False

    @property
    def turn(self) -> int:
        return len(self.guesses)

    @property
    def over(self) -> bool:
        return self.cracked or self.turn == self.turns


def parsed(model: type[Task] | type[Game], raw: dict[str, Any]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:  # raised as InvalidInput: a 422 (task) or a refused record
        raise InvalidInput(f"bad mastermind {model.__name__}: {exc.errors()[0]['msg']}") from None


def new_game(seed: int) -> Any:
    game = ta.make(env_id="Mastermind-v0")
    game.reset(num_players=1, seed=seed)
    return game


def game_state(game: Any) -> Any:
    """textarena's own state object (under its wrappers)."""
    while hasattr(game, "env"):
        game = game.env
    return game.state


def prompt_tokens(game: Game) -> list[int]:
    """The policy's prompt: the guesses and pegs so far, as small token ids."""
    tokens = [200 + game.seed % 100, 300 + game.turn]
    for g in game.guesses:
        tokens += [*g.code, 10 + g.black, 20 + g.white]
    return tokens


def guess_from(tokens: list[int], taken: set[tuple[int, ...]]) -> tuple[int, ...]:
    """A code picked by the tokens, never one guessed before (textarena refuses a repeat)."""
    start = sum(tokens) % len(GUESSES)
    for i in range(len(GUESSES)):
        code = GUESSES[(start + i) % len(GUESSES)]
        if code not in taken:
            return code
    raise AssertionError("every code guessed")  # 20 turns at most, 360 codes


class Ledger:
    """The append-only ledger guesses are submitted to: it keeps duplicates, as a real
    downstream system that is not idempotent would."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines = len(path.read_text().splitlines()) if path.exists() else 0

    def submit(self, key: EffectKey, code: tuple[int, ...]) -> int:
        line = json.dumps({"key": key.id, "code": list(code)})
        with self.path.open("a") as f:
            f.write(line + "\n")
        self.lines += 1
        return self.lines  # the receipt: the line's number


class Mastermind(EnvironmentHooks):
    name = "mastermind"

    def __init__(self, context: ServeContext) -> None:
        if context.engine is None:
            raise InvalidInput("mastermind needs --engine-url: the policy picks every guess")
        if "ledger" not in context.options:
            raise InvalidInput("mastermind needs --hooks-option ledger=PATH (a JSON-lines file)")
        self.engine = context.engine
        self.ledger = Ledger(Path(context.options["ledger"]))
        self.live: dict[str, tuple[Game, Any]] = {}  # episode key -> (record, textarena game)

    async def run_episode(self, run: RunEpisode, session: EpisodeSession) -> EpisodeResult:
        task: Task = parsed(Task, run.task)
        record = session.restored
        game = parsed(Game, record) if record else Game(**task.model_dump())
        played, key = self.resume_game(game), session.episode.key
        try:
            while True:
                self.live[key] = (game, played)
                await session.boundary(game.turn)
                if game.over:
                    break
                request = session.request(game.turn, prompt_tokens(game), max_tokens=MAX_TOKENS)
                completion = await session.complete(self.engine, request)
                with session.tool():
                    game = await self.play(session, game, played, completion)
        finally:
            self.live.pop(key, None)
        return EpisodeResult(
            episode=session.episode,
            reward=self.reward(played),
            turns=game.turn,
            restored=False,
            info={"guesses": [g.model_dump(mode="json") for g in game.guesses]},
        )

    def resume_game(self, game: Game) -> Any:
        """A textarena game at the record's turn: the guesses replayed (no effect: submitted
        when they were made)."""
        played = new_game(game.seed)
        for g in game.guesses:
            played.step(f"[{' '.join(map(str, g.code))}]")
        return played

    async def play(
        self, session: EpisodeSession, game: Game, played: Any, completion: Completion
    ) -> Game:
        taken = {g.code for g in game.guesses}
        if game.play_out:
            taken.add(tuple(game_state(played).game_state["secret_code"]))
        code = guess_from(list(completion.tokens), taken)
        await session.effect(
            game.turn, "submit", lambda key: self.ledger.submit(key, code), args=list(code)
        )
        played.step(f"[{' '.join(map(str, code))}]")
        last = game_state(played).game_state["history"][-1]
        guess = Guess(code=code, black=last["black"], white=last["white"])
        cracked = guess.black == 4
        return game.model_copy(update={"guesses": (*game.guesses, guess), "cracked": cracked})

    def reward(self, played: Any) -> float:
        history = game_state(played).game_state["history"]
        if not history:
            return 0.0
        last = history[-1]
        return 1.0 if last["black"] == 4 else (last["black"] + last["white"] / 2) / 4

    def export_episode(self, episode: EpisodeRef) -> dict[str, Any]:
        if episode.key not in self.live:
            raise InvalidInput(f"mastermind holds no live episode {episode.key}")
        return self.live[episode.key][0].model_dump(mode="json")

    def restore_episode(self, episode: EpisodeRef, record: dict[str, Any]) -> None:
        parsed(Game, record)

    def state_digest(self, episode: EpisodeRef) -> str | None:
        game, played = self.live[episode.key]
        state = game_state(played)
        hidden = {"game": state.game_state, "turn": state.turn, "errors": state.error_count}
        whole = {"record": game.model_dump(mode="json"), "textarena": hidden}
        return hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()

    def drop_episode(self, episode: EpisodeRef) -> None:
        self.live.pop(episode.key, None)
