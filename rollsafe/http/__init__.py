"""rollsafe's HTTP plumbing shared by the engine and environment servers and their clients."""
