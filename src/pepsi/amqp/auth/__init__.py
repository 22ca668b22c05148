"""Who may log in to the AMQP listener and what they may touch: passwords, permissions.

Pure. Imports `wire` only (the reply codes a refusal carries).
"""
