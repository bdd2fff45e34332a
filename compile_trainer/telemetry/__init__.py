"""Telemetry without Lightning: compile events attributed to regions, advice, and throughput."""
