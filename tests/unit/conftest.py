"""Unit fixtures: a chat codec on a BPE trained here, made once per test process (training it
takes seconds; the gateway's and the scripted engine's tests share it)."""

from __future__ import annotations

import pytest

from rollsafe.engine.text import ChatCodec, write_tokenizer


@pytest.fixture(scope="session")
def codec(tmp_path_factory: pytest.TempPathFactory) -> ChatCodec:
    return ChatCodec.load(write_tokenizer(tmp_path_factory.mktemp("codec")))
