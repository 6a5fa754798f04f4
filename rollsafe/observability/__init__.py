"""What a run shows about its checkpoints: metrics, traces, and the timeline."""
