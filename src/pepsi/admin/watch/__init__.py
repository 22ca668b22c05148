"""Watching the pipeline: the dispatcher's live snapshots, `pepsi top`'s reads and
arithmetic, and which running rows a worker holds.
"""
