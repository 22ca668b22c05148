"""Subcommands an operator uses on a running pipeline: queue, top, settings, config, telemetry."""
