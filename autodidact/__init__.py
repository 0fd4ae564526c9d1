"""autodidact package."""
