"""episodes package."""
