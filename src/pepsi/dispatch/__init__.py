"""The dispatcher: one process that claims pending rows and feeds worker pools."""
