"""Synthetic verifiable tasks for tiny CPU runs and tests."""
