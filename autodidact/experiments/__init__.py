"""Experiment harnesses: commands that run whole ``autodidact run``s and write a docs page of
what they measured (``autodidact ablation``: ``arms.py`` runs the cells, ``page.py`` writes the
table, plot, doc and json).
"""
