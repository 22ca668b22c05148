"""Consuming: a channel's basic.* for receiving, and the deliverer that feeds them.

`consuming.py` is the channel's half (`ConsumingChannel`, mixed into
`broker.BrokerChannel`); `delivery.py` the `Deliverer`, made of three parts on one
state (`state.py`): the read-ahead the dispatcher's claim fills (`readahead.py`),
sending it to consumers as their credit allows (`pump.py`), and their outcomes
written to the rows (`settle.py`). Pure parts: `fetched.py` (a loaded row as a
delivery needs it) and `outcomes.py` (outcomes waiting for their commit).
"""
