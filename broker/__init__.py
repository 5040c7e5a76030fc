"""The mlscope server: job intake, agent resolution, load generation, trace ingest."""
