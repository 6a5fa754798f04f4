"""What a run leaves behind and how it is checked: evidence files, ``rollsafe verify``, and
scenario files replayed against the real run state."""
