"""Subcommands that run a process: the dispatcher, a worker, the ingress, the console,
the failure bouncer, and the systemd units that start them.
"""
