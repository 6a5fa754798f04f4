"""``rollsafe doctor``'s environment-instance rows: each instance of ``participants.envs``
answers under the name the run gives it, with the run's token; a misnamed one is named with
both names and the fix. The participant app on ``httpx.ASGITransport``."""

from __future__ import annotations

import httpx

from rollsafe.cli.doctor.checks import Status
from rollsafe.cli.doctor.participants import env_checks
from rollsafe.env.participant import Participant
from rollsafe.env.router import participant_app
from rollsafe.settings import ParticipantsSection
from rollsafe.testing.envs import Idle

TOKEN = "doctor-token"


def transport(instance: str) -> httpx.ASGITransport:
    return httpx.ASGITransport(app=participant_app(Participant(instance, Idle()), TOKEN))


async def test_an_instance_under_its_own_name_is_ok_and_a_misnamed_one_is_named() -> None:
    envs = {"w0": "http://w0.test", "w1": "http://w1.test"}
    participants = ParticipantsSection(envs=envs)
    env = {"ROLLSAFE_ENV_TOKEN": TOKEN}
    good = await env_checks(participants, 5.0, env, transport("w0"))  # both URLs reach "w0"
    by_name = {row.name: row for row in good}
    assert by_name["environment w0"].status is Status.OK
    assert "instance w0, idle" in by_name["environment w0"].detail
    wrong = by_name["environment w1"]
    assert wrong.status is Status.FAILED
    assert "names the instance at http://w1.test 'w1', but it calls itself 'w0'" in wrong.detail
    assert wrong.fix == "restart it with `--instance w1`, or rename it in participants.envs"


async def test_a_wrong_token_no_token_and_no_instances_are_findings() -> None:
    participants = ParticipantsSection(envs={"w0": "http://w0.test"})
    (refused,) = await env_checks(participants, 5.0, {"ROLLSAFE_ENV_TOKEN": "x"}, transport("w0"))
    assert refused.status is Status.FAILED and "refused the token" in refused.detail
    (missing,) = await env_checks(participants, 5.0, {}, transport("w0"))
    assert missing.status is Status.FAILED and "ROLLSAFE_ENV_TOKEN" in missing.detail
    (none,) = await env_checks(ParticipantsSection(), 5.0, {})
    assert none.status is Status.SKIPPED
