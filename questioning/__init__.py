"""questioning package."""
