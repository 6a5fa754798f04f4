"""Worker entrypoints: build a client and a worker, register workflows and activities."""
