"""Command-line entry points (armor-train, armor-convert, armor-eval)."""
