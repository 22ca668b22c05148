"""Built-in stages: `PROGRAM = pepsi-stage-NAME` in pepsi.conf, no Python to write.

    if       route on a condition over the message's metadata (IF, THEN, ELSE)
    set      write state keys (SET), then go on to NEXT; `tag` is the same stage
    discard  finish the message here
    bounce   hand the message to the failure path (BOUNCE_STAGE, or failed)

Each is a metadata-only `@stage` (batched, and fusable when fusion comes):
`options` (the registry and the options parsed at load, pure), `condition`
(the IF language: tree, parser, renderer) and `evaluation` (a tree against
a message, pure), and one module per stage function, imported by a worker
only for the stage it runs. See docs/stages.md#built-in-stages.
"""
