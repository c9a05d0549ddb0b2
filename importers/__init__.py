"""Traces of training jobs ranktrace did not run, turned into its telemetry and store."""
