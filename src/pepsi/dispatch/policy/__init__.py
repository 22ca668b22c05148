"""What the dispatcher decides: fairness, pool sizing, worker decisions, back-pressure.

Pure: facts and an injected clock in, decisions out. No I/O, no asyncio.
"""
