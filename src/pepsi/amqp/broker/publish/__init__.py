"""The publish side of the broker: a channel's publishes become rows, many per commit.

A channel's basic.publish, confirm and tx modes (`publishing`, `modes`); what they
read of a publish (`properties`, `columns`); the batcher that writes every channel's
publishes in one transaction (`batcher`, with `units`, `params`, `arrays`) and the
confirms sent once it commits (`confirms`).
"""
