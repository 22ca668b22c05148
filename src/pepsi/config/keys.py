"""Each section's keys: KEY -> (dataclass field, parser), and a section parsed by them.

One table per section of pepsi.conf (`[pepsi-ingress]`'s is in `ingress`,
with its checks; a built-in stage adds its own keys to `STAGE_KEYS`). The
defaults live on the dataclasses of `model`, not here.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

from pepsi.config import values as v
from pepsi.config.ingress import INGRESS_KEYS
from pepsi.config.model import MIB, RawValue
from pepsi.errors import ConfigError

# Each section: KEY -> (dataclass field, parser). Defaults live on the dataclasses.
Spec = Mapping[str, tuple[str, Callable[[str], Any]]]

PEPSI_KEYS: Spec = {
    "ALLOW_FUSION": ("allow_fusion", v.boolean),
    "SHARE_TELEMETRY": ("share_telemetry", v.boolean),
}
DISPATCH_KEYS: Spec = {
    "CONFIG_FILE": ("config_file", v.path),
    "POLL_INTERVAL": ("poll_interval", v.duration()),
    "STATS_INTERVAL": ("stats_interval", v.duration(1.0)),
    "FAIR_SCHEDULING": ("fair_scheduling", v.boolean),
    "FAIR_HALF_LIFE": ("fair_half_life", v.duration(1.0)),
    "FAIR_FIFO_PERCENT": ("fair_fifo_percent", v.integer(0, 100)),
    "WORKER_IDLE_TIMEOUT": ("worker_idle_timeout", v.duration()),
    "STRIKE_DELAY": ("strike_delay", v.duration()),
    "DB_ERROR_PAUSE": ("db_error_pause", v.duration()),
    "TEMPFAIL_WINDOW": ("tempfail_window", v.duration()),
    "START_COOLDOWN": ("start_cooldown", v.duration()),
    "METRICS_ADDRESS": ("metrics_address", v.listen_address),
    "VACUUM_AFTER": ("vacuum_after", v.integer(0)),
    "LOCK_WAIT": ("lock_wait", v.duration()),
    "WORKER_READY_TIMEOUT": ("worker_ready_timeout", v.duration()),
    "WORKER_STOP_TIMEOUT": ("worker_stop_timeout", v.duration()),
    "WORKER_KILL_GRACE": ("worker_kill_grace", v.duration()),
    "RECONNECT_MAX_DELAY": ("reconnect_max_delay", v.duration(0.1)),
}
POSTGRES_KEYS: Spec = {
    "DSN": ("dsn", v.text),
    "WORKER_DSN": ("worker_dsn", v.text),
    "DATA_DIR": ("data_dir", v.path),
    "WORKER_SYNCHRONOUS_COMMIT": ("worker_synchronous_commit", v.boolean),
    "POOL_MIN_SIZE": ("pool_min_size", v.integer(1, 1000)),
    "POOL_MAX_SIZE": ("pool_max_size", v.integer(1, 1000)),
    "CONNECT_TIMEOUT": ("connect_timeout", v.duration(1.0)),
}
BOUNCER_KEYS: Spec = {
    "SINK": ("sink", v.sink),
    "INTERVAL": ("interval", v.duration(0.1)),
}
STAGE_KEYS: Spec = {
    "PROGRAM": ("program", v.program),
    "HANDLER": ("handler", v.handler),
    "NEXT": ("next", v.stage_ref),
    "PARALLELISM": ("parallelism", v.integer(1, 1000)),
    "QUEUE_LIMIT": ("queue_limit", v.integer(1, 10000)),
    "MAX_MESSAGES": ("max_messages", v.integer(1)),
    "MAX_RUNTIME": ("max_runtime", v.duration()),
    "MAX_LIFETIME": ("max_lifetime", v.duration()),
    "RETRY_DELAY": ("retry_delay", v.duration()),
    "RETRY_MAX_DELAY": ("retry_max_delay", v.duration()),
    "BOUNCE_STAGE": ("bounce_stage", v.stage_ref),
    "FUSION": ("fusion", v.boolean),
    "MAX_LENGTH": ("max_length", v.integer(1)),
    "OVERFLOW": ("overflow", v.overflow),
    "TTL": ("ttl", v.duration()),
}
AMQP_KEYS: Spec = {
    "LISTEN": ("listen", v.listen_address),
    "HEARTBEAT": ("heartbeat", v.integer(0, 65535)),
    "FRAME_MAX": ("frame_max", v.integer(4096, 0xFFFFFFFF)),
    "CHANNEL_MAX": ("channel_max", v.integer(1, 65535)),
    "HANDSHAKE_TIMEOUT": ("handshake_timeout", v.duration(0.1)),
    "MAX_MESSAGE_SIZE": ("max_message_size", v.size(1, 512 * MIB)),
    "STAGES": ("stages", v.stage_names),
    "MAX_CONNECTIONS": ("max_connections", v.integer(1)),
    "CLIENT_CONNECTION_LIMIT": ("client_connection_limit", v.integer(1)),
    "PUBLISH_BUFFER": ("publish_buffer", v.size(MIB, 1024 * 1024 * MIB)),
    "CONNECTION_PUBLISH_BUFFER": ("connection_publish_buffer", v.size(MIB, 1024 * 1024 * MIB)),
}
WEB_KEYS: Spec = {
    "LISTEN": ("listen", v.listen_address),
    "PASSWORD": ("password", v.password_hash),
    "READ_ONLY": ("read_only", v.boolean),
    "SESSION_TTL": ("session_ttl", v.duration(60.0)),
    "PUBLIC_URL": ("public_url", v.public_url),
}
SECTIONS: Mapping[str, Spec] = {
    "pepsi": PEPSI_KEYS,
    "pepsi-dispatch": DISPATCH_KEYS,
    "pepsi-postgres": POSTGRES_KEYS,
    "pepsi-ingress": INGRESS_KEYS,
    "pepsi-failure-bouncer": BOUNCER_KEYS,
    "pepsi-amqp": AMQP_KEYS,
    "pepsi-web": WEB_KEYS,
}


def parse_section(section: str, keys: Mapping[str, RawValue], spec: Spec) -> dict[str, Any]:
    """One section's values by field, parsed by `spec`; ConfigError on a key it lacks."""
    values: dict[str, Any] = {}
    for key, raw in keys.items():
        if key not in spec:
            hint = difflib.get_close_matches(key, list(spec), n=1)
            problem = "unknown key" + (f" (did you mean {hint[0]}?)" if hint else "")
            raise ConfigError(problem, file=raw.origin, section=section, key=key)
        attr, parse = spec[key]
        try:
            values[attr] = parse(raw.value)
        except ValueError as exc:
            raise ConfigError(str(exc), file=raw.origin, section=section, key=key) from None
    return values
