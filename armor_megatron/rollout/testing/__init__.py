"""Test doubles and tiny fixtures for the rollout package (CPU, no downloads)."""
