"""Shared pytest set-up for every suite."""
