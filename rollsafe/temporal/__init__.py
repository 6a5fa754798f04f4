"""Temporal plumbing: connection settings, the local dev server, search attributes.

- ``rollsafe.temporal.search_attributes``: the RollsafeRunId/Phase/Kind keys (sandbox-safe)
- ``rollsafe.temporal.connect``: ``ConnectionSettings`` and ``connect`` (pydantic converter)
- ``rollsafe.temporal.devserver``: ``DevServer``, the Temporal CLI's dev server as a subprocess
- ``rollsafe.cli.server``: ``server_command``, the ``rollsafe server`` command

Deliberately empty: workflow modules import ``search_attributes`` inside the workflow sandbox,
which re-executes this file; importing ``devserver`` (subprocess, fcntl) or the client here
would drag them into every workflow run.
"""
