"""Changing the configuration live: per-address settings, the database overlay, the
telemetry switch.
"""
