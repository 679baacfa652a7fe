"""Helpers for the development tools around hetc (the Makefile's `browser` target, the page tests)."""

__all__: list[str] = []
