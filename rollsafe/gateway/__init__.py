"""An OpenAI-compatible gateway whose sessions are checkpointed (docs/gateway.md).

Agents written against the OpenAI API (chat completions, the Responses API) and NeMo Gym's
agents and resources servers run unmodified: the gateway turns their text into the engines'
token ids (:mod:`rollsafe.engine.text`), records each session's model and tool calls, takes part
in the run's checkpoints as an environment participant, and after a restore replays a session
from its record, exactly once for every tool effect.

Modules: :mod:`~rollsafe.gateway.wire` (the API's models), :mod:`~rollsafe.gateway.convert`
(requests to prompts, answers to replies), :mod:`~rollsafe.gateway.record` (a session's record
and its replay; pure), :mod:`~rollsafe.gateway.sessions` (one live session),
:mod:`~rollsafe.gateway.hooks` (the checkpoint participant), :mod:`~rollsafe.gateway.agents`
(an episode's entry point), :mod:`~rollsafe.gateway.tools` (the tool proxy),
:mod:`~rollsafe.gateway.app` and :mod:`~rollsafe.gateway.serve` (HTTP).
"""
