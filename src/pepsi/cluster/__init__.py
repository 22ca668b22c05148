"""A replicated PostgreSQL for development and tests: three nodes under Patroni.

`layout` is the pure part (ports, paths, the Patroni configuration that
carries the quorum guarantee); `harness` starts, kills and watches the
processes. Production clusters are built by their operators with the same
settings: docs/replication.md.
"""
