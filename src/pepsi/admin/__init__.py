"""Operating Pepsi: the domain behind `pepsi queue`, `pepsi top`, `pepsi db status` and
`pepsi failure-bouncer`, shared with the web console and the metrics.

    queue       inspection (status, list, show) and repair (resume, retry, move,
                delete; single or by filter, each one transaction)
    bouncer     the failure bouncer: failed rows of stages without BOUNCE_STAGE
                to the dead-letter sink, as a service (`run_once()` and a loop)
    top         the view's arithmetic, pure: successive samples to one frame
    activity    the view's reads: queue counts, statistics, workers, dispatcher
    database    the database in use: embedded or not, server, schema, queue
    connection  a connection refused unless its schema is this build's
    horizon     the oldest transaction holding back vacuum: its read, the
                warning, the metrics probe

Functions take a psycopg connection (or the config to open one), return
frozen dataclasses and raise `PepsiError`s for what a user asked wrong; none
prints, parses arguments or exits. The submodules are imported by name:
this package imports nothing, so a pure module stays free of the driver.
"""
