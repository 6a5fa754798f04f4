"""The custom search attributes rollsafe workflows publish (docs/design.md section 5).

Operators find stuck checkpoints with stock tools, e.g.
``temporal workflow list --query "RollsafePhase='drain'"``. A server must have the attributes
registered before a workflow upserts them; the dev server registers them at start from
``SEARCH_ATTRIBUTE_CLI_ARGS``.
"""

from __future__ import annotations

from typing import Final

from temporalio.common import SearchAttributeKey

RUN_ID: Final = SearchAttributeKey.for_keyword("RollsafeRunId")
PHASE: Final = SearchAttributeKey.for_keyword("RollsafePhase")
KIND: Final = SearchAttributeKey.for_keyword("RollsafeKind")

ALL: Final[tuple[SearchAttributeKey[str], ...]] = (RUN_ID, PHASE, KIND)

# `temporal server start-dev` spells the type "Keyword"; one flag pair per attribute.
SEARCH_ATTRIBUTE_CLI_ARGS: Final[tuple[str, ...]] = tuple(
    arg for key in ALL for arg in ("--search-attribute", f"{key.name}=Keyword")
)
