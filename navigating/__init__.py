"""navigating package."""
