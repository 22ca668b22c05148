"""The dispatcher's services, one class each: listener, claimer, sweeper, flusher,
vacuum, reload, the live snapshot and the metrics endpoint.
"""
