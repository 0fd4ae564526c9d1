"""actor package."""
