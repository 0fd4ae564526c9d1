"""The experience role: grows the shared experience pool from finished groups (worker.py)."""
