#!/bin/sh
# A Pepsi stage in POSIX shell: psql and the worker protocol, nothing else.
#
# Configure it as `PROGRAM = /path/to/protocol_worker.sh`. The dispatcher starts
# it with `worker` as its last argument and PEPSI_STAGE, PEPSI_DSN and
# PEPSI_NEXT in the environment. It advances each message to the stage's NEXT,
# or finishes it at the last stage. One psql run (one connection) per message:
# an illustration, not a fast worker.

stage=${PEPSI_STAGE:?PEPSI_STAGE is not set}
dsn=${PEPSI_DSN:?PEPSI_DSN is not set}
next=${PEPSI_NEXT-}

# Stage names are [a-z0-9_-] (the configuration enforces it), so they can be
# written into SQL as literals; refuse to run (exit 78) on anything else.
case $stage$next in *[!a-z0-9_-]*) echo "bad stage name" >&2; exit 78 ;; esac

# A lost advance only repeats this stage, so commits need not wait for the disk.
PGOPTIONS="${PGOPTIONS-} -c synchronous_commit=off"
export PGOPTIONS

psql "$dsn" -qAt -c "SELECT 1" >/dev/null || exit 1  # the database answers
echo ready

while IFS= read -r id; do  # one message id per line
    case $id in '' | *[!0-9]*) echo "not a message id: $id" >&2; exit 1 ;; esac
    # Guarded: only a row still running at this stage, so a late write after
    # a reset is a no-op.
    if [ -n "$next" ]; then  # advance: one UPDATE
        sql="UPDATE pepsi.workqueue SET stage = '$next', status = 'pending'
             WHERE workqueue_id = $id AND status = 'running' AND stage = '$stage'"
    else  # finish: delete the row
        sql="DELETE FROM pepsi.workqueue
             WHERE workqueue_id = $id AND status = 'running' AND stage = '$stage'"
    fi
    # psql's output must not reach stdout: stdout carries the status lines.
    psql "$dsn" -qAt -v ON_ERROR_STOP=1 -c "$sql" >/dev/null || exit 1
    echo 0  # one status line per id, in order
done
